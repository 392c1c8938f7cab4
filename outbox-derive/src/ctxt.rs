//! Error collection: every stage records its mistakes here instead of stopping at the
//! first, so the user sees all of them in one build (as serde's `internals::Ctxt`).

use std::cell::RefCell;
use std::fmt::Display;

use proc_macro2::Span;

/// The errors recorded so far, each with its span.
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: RefCell<Vec<syn::Error>>,
}

impl Ctxt {
    pub(crate) fn push(&self, error: syn::Error) {
        self.errors.borrow_mut().push(error);
    }

    pub(crate) fn error(&self, span: Span, msg: impl Display) {
        self.push(syn::Error::new(span, msg));
    }

    /// `msg` with a `help:` line under it, the shape of every outbox diagnostic.
    pub(crate) fn help(&self, span: Span, msg: impl Display, help: impl Display) {
        self.error(span, format_args!("{msg}\nhelp: {help}"));
    }

    /// All recorded errors folded into one, or `Ok` when there were none.
    pub(crate) fn finish(self) -> Result<(), syn::Error> {
        let mut errors = self.errors.into_inner().into_iter();
        let Some(mut first) = errors.next() else {
            return Ok(());
        };
        for e in errors {
            first.combine(e);
        }
        Err(first)
    }
}
