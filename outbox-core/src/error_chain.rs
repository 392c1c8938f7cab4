//! Printing an error together with its causes.
//!
//! The errors of this workspace follow the Rust API guidelines' convention: an error's
//! `Display` says only what failed at its own layer ("store error", "database error"),
//! and its cause is reached through [`std::error::Error::source`], never repeated in the
//! text. Whoever shows an error to a person (a log line, a dead-letter reason, the CLI)
//! therefore walks the chain, with [`error_chain`].

use std::error::Error as StdError;
use std::fmt;

/// Shows `error` and every cause in its [`source`](StdError::source) chain on one line,
/// outermost first, joined by `": "`: `store error: database error: connection refused`.
///
/// Use it wherever an error reaches a person: `tracing::warn!(error = %error_chain(&e), ..)`,
/// `eprintln!("error: {}", error_chain(&e))`, a dead-letter reason
/// (`error_chain(&e).to_string()`). A cause whose text is the same as the one before it is
/// shown once: some foreign errors (redis's `RedisError` over an I/O error, for one) show
/// their source's text as their own and return it from `source()` as well.
///
/// ```
/// use outbox_core::{Error, error_chain};
///
/// let e = Error::store("connection refused");
/// assert_eq!(e.to_string(), "store error");
/// assert_eq!(error_chain(&e).to_string(), "store error: connection refused");
/// ```
pub fn error_chain<E: StdError + ?Sized>(error: &E) -> ErrorChain<'_, E> {
    ErrorChain { error }
}

/// An error and its causes, displayed on one line; made by [`error_chain`]. It is `Send`
/// and `Sync` when the error is, so it may live across an `.await`.
pub struct ErrorChain<'a, E: ?Sized> {
    error: &'a E,
}

impl<E: StdError + ?Sized> ErrorChain<'_, E> {
    /// The error, then each cause, outermost first, without a cause whose text repeats
    /// the one before it: what [`Display`](fmt::Display) joins, for printers that lay the
    /// causes out one per line.
    pub fn texts(&self) -> Vec<String> {
        let mut texts = vec![self.error.to_string()];
        let mut next = self.error.source();
        while let Some(e) = next {
            let text = e.to_string();
            if texts.last() != Some(&text) {
                texts.push(text);
            }
            next = e.source();
        }
        texts
    }
}

impl<E: StdError + ?Sized> fmt::Display for ErrorChain<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.texts().join(": "))
    }
}

impl<E: StdError + ?Sized> fmt::Debug for ErrorChain<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that shows its source's text as its own, as redis's `RedisError` does.
    #[derive(Debug)]
    struct Echo(std::io::Error);

    impl fmt::Display for Echo {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            self.0.fmt(f)
        }
    }

    impl StdError for Echo {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_layer_is_shown_once_outermost_first() {
        let inner = crate::Error::store("connection refused");
        let outer = crate::Error::Handler(Box::new(inner));
        assert_eq!(outer.to_string(), "handler failed");
        assert_eq!(
            error_chain(&outer).to_string(),
            "handler failed: store error: connection refused"
        );
        assert_eq!(
            error_chain(&outer).texts(),
            ["handler failed", "store error", "connection refused"]
        );
    }

    #[test]
    fn a_cause_repeating_its_wrappers_text_is_shown_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = crate::Error::broker_unavailable(Echo(io));
        assert_eq!(error_chain(&e).to_string(), "broker unavailable: refused");
    }

    #[test]
    fn an_error_without_a_source_is_its_own_text() {
        let e = crate::Error::UnknownEventType("Nope".into());
        assert_eq!(
            error_chain(&e).to_string(),
            "no handler for event type `Nope`"
        );
    }
}
