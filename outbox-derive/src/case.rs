//! The default topic: a type name split at case changes, lowercased and joined with dots.

/// `OrderPaid` → `order.paid`, `HTTPRequestSent` → `http.request.sent`, `V2Order` → `v2.order`.
pub(crate) fn dotted(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c == '_' {
            if !out.is_empty() && !out.ends_with('.') {
                out.push('.');
            }
            continue;
        }
        if i > 0 && c.is_uppercase() && !out.is_empty() && !out.ends_with('.') {
            let prev = chars[i - 1];
            let next_is_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
            // A new word starts after a lowercase letter or digit, or at the last capital of
            // an acronym that is followed by a lowercase letter (`HTTPRequest`).
            if prev.is_lowercase()
                || prev.is_ascii_digit()
                || (prev.is_uppercase() && next_is_lower)
            {
                out.push('.');
            }
        }
        out.extend(c.to_lowercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::dotted;

    #[test]
    fn splits_at_case() {
        assert_eq!(dotted("OrderPaid"), "order.paid");
        assert_eq!(dotted("AccountTransferred"), "account.transferred");
        assert_eq!(dotted("HTTPRequestSent"), "http.request.sent");
        assert_eq!(dotted("Order2Paid"), "order2.paid");
        assert_eq!(dotted("Paid"), "paid");
        assert_eq!(dotted("order_paid"), "order.paid");
    }
}
