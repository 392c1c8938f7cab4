//! `#[derive(OutboxEvent)]`: an implementation detail of `outbox-core`, which re-exports it
//! and documents its attributes. Depend on `outbox-core` instead of this crate.
//!
//! The derive runs in four stages, one module each: `attr` parses the `#[outbox(...)]`
//! attributes, `ast` builds the model of the event type from them, `valid` checks the
//! model, and `expand` generates the impls. Errors are collected in a `ctxt::Ctxt` across
//! the stages.

mod ast;
mod attr;
mod case;
mod ctxt;
mod expand;
mod valid;

use proc_macro::TokenStream;

/// Derives `outbox_core::OutboxEvent`; see the re-export in `outbox-core` for the attributes.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive(&input).into()
}
