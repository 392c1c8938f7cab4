//! Reading query plans, for the tests that check a query uses its index (outbox-diesel's
//! `ordered_claim.rs` and `relay_stores.rs`). The tests run `EXPLAIN` themselves (that
//! needs a connection); these functions read what it printed.

use serde_json::Value;

/// The numbers of every `Rows Removed by Filter: N` line of a PostgreSQL
/// `EXPLAIN ANALYZE` text plan: the rows an access read and threw away.
pub fn pg_rows_removed_by_filter(plan: &[String]) -> Vec<u64> {
    plan.iter()
        .filter_map(|line| line.trim().strip_prefix("Rows Removed by Filter: "))
        .map(|n| n.parse().expect("a row count"))
        .collect()
}

/// One table access of a MariaDB `ANALYZE FORMAT=JSON` plan.
#[derive(Debug, Clone, PartialEq)]
pub struct TableAccess {
    /// The index used (`"none"` for a table scan).
    pub key: String,
    /// The rows it examined (`r_rows`; `None` if the plan does not say).
    pub rows: Option<f64>,
}

/// Every table access of a MariaDB `ANALYZE FORMAT=JSON` plan, in plan order (the
/// outermost first).
pub fn mariadb_table_accesses(plan: &str) -> Vec<TableAccess> {
    let json: Value = serde_json::from_str(plan).expect("a JSON plan");
    let mut found = Vec::new();
    collect_accesses(&json, &mut found);
    found
}

fn collect_accesses(v: &Value, out: &mut Vec<TableAccess>) {
    match v {
        Value::Object(m) => {
            if let Some(t) = m.get("table")
                && t.get("table_name").is_some()
            {
                out.push(TableAccess {
                    key: t["key"].as_str().unwrap_or("none").to_owned(),
                    rows: t["r_rows"].as_f64(),
                });
            }
            m.values().for_each(|x| collect_accesses(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| collect_accesses(x, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_filtered_rows_are_read_from_every_line() {
        let plan = [
            "Limit (actual rows=10 loops=1)".to_owned(),
            "  ->  Index Scan using outbox_pending on outbox".to_owned(),
            "        Rows Removed by Filter: 7".to_owned(),
            "        Rows Removed by Filter: 0".to_owned(),
        ];
        assert_eq!(pg_rows_removed_by_filter(&plan), [7, 0]);
    }

    #[test]
    fn mariadb_accesses_are_found_outermost_first() {
        let plan = r#"{"query_block": {"nested_loop": [
            {"table": {"table_name": "outbox", "key": "outbox_claim", "r_rows": 12}},
            {"table": {"table_name": "o2", "r_rows": 3.5}}
        ]}}"#;
        assert_eq!(
            mariadb_table_accesses(plan),
            [
                TableAccess {
                    key: "outbox_claim".into(),
                    rows: Some(12.0)
                },
                TableAccess {
                    key: "none".into(),
                    rows: Some(3.5)
                },
            ]
        );
    }
}
