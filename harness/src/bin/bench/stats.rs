//! Rounds, ratios and the results table.

use std::fmt::Write as _;

/// How a figure is judged against its target.
#[derive(Clone, Copy)]
pub(crate) enum Target {
    /// The median must be at least this.
    AtLeast(f64),
    /// The median must be at most this.
    AtMost(f64),
    /// Shown, not judged.
    None,
}

/// One row of the table: a ratio (or an absolute figure) measured over rounds.
pub(crate) struct Figure {
    pub(crate) group: &'static str,
    pub(crate) name: String,
    /// What is measured / what it is compared with (for ratios).
    pub(crate) compared: String,
    pub(crate) values: Vec<f64>,
    pub(crate) unit: &'static str,
    pub(crate) target: Target,
}

impl Figure {
    pub(crate) fn ratio(
        group: &'static str,
        name: impl Into<String>,
        compared: impl Into<String>,
        target: Target,
    ) -> Self {
        Self {
            group,
            name: name.into(),
            compared: compared.into(),
            values: Vec::new(),
            unit: "×",
            target,
        }
    }

    pub(crate) fn absolute(
        group: &'static str,
        name: impl Into<String>,
        unit: &'static str,
        target: Target,
    ) -> Self {
        Self {
            group,
            name: name.into(),
            compared: String::new(),
            values: Vec::new(),
            unit,
            target,
        }
    }

    pub(crate) fn median(&self) -> f64 {
        median(&self.values)
    }

    fn range(&self) -> (f64, f64) {
        let min = self.values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self
            .values
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }

    fn verdict(&self) -> &'static str {
        if self.values.is_empty() {
            return "–";
        }
        let m = self.median();
        match self.target {
            Target::AtLeast(t) if m >= t => "holds",
            Target::AtMost(t) if m <= t => "holds",
            Target::None => "",
            _ => "MISSED",
        }
    }

    fn target_text(&self) -> String {
        match self.target {
            Target::AtLeast(t) => format!("≥ {}", trim(t)),
            Target::AtMost(t) => format!("≤ {}", trim(t)),
            Target::None => String::new(),
        }
    }
}

pub(crate) fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if !v.len().is_multiple_of(2) {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// The 99th percentile (0 for no values).
pub(crate) fn p99(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

fn trim(x: f64) -> String {
    let s = format!("{x:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn number(x: f64, unit: &str) -> String {
    match unit {
        "×" => format!("{x:.2}"),
        "ms" => format!("{x:.2}"),
        _ if x.abs() >= 100.0 => format!("{x:.0}"),
        _ => format!("{x:.1}"),
    }
}

/// The table as Markdown: figure, compared with, median, range over rounds, rounds,
/// target, and whether the median meets it (unless `judge` is false: tiny runs).
pub(crate) fn table(figures: &[Figure], judge: bool) -> String {
    let mut out = String::new();
    out.push_str("| | figure | measured / baseline | median | range | rounds | target | |\n");
    out.push_str("|---|---|---|---:|---:|---:|---|---|\n");
    for f in figures {
        let (min, max) = f.range();
        let unit = if f.unit == "×" { "" } else { f.unit };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} {unit} | {}–{} | {} | {} | {} |",
            f.group,
            f.name,
            f.compared,
            number(f.median(), f.unit),
            number(min, f.unit),
            number(max, f.unit),
            f.values.len(),
            f.target_text(),
            if judge { f.verdict() } else { "" },
        );
    }
    out
}
