#![doc = include_str!("../README.md")]

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

// `OutboxEvent` as the `typed-outbox` facade re-exports it: the same derive, reaching the
// facade (`::outbox`) instead of `::outbox_core`, as its users depend on the facade alone.
// A plain comment: the facade's re-export carries the docs.
#[doc(hidden)]
#[proc_macro_derive(FacadeOutboxEvent, attributes(outbox))]
pub fn derive_facade_outbox_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive_in(&input, "outbox").into()
}
