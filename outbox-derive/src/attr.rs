//! Parsing of `#[outbox(...)]` attributes. Every mistake is recorded with its span in a
//! [`Ctxt`] so the user sees all of them in one build.

use std::cell::RefCell;

use proc_macro2::Span;
use syn::{Attribute, Ident, LitInt, LitStr};

/// Collects errors instead of stopping at the first one (as serde's `internals::Ctxt`).
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: RefCell<Vec<syn::Error>>,
}

impl Ctxt {
    pub(crate) fn push(&self, error: syn::Error) {
        self.errors.borrow_mut().push(error);
    }

    pub(crate) fn error(&self, span: Span, msg: impl std::fmt::Display) {
        self.push(syn::Error::new(span, msg));
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

/// A value with the span it was written at.
pub(crate) struct Spanned<T> {
    pub(crate) value: T,
    pub(crate) span: Span,
}

/// What `#[outbox(...)]` on a struct, enum or variant may say.
#[derive(Default)]
pub(crate) struct ContainerAttrs {
    pub(crate) topic: Option<Spanned<String>>,
    pub(crate) name: Option<Spanned<String>>,
    pub(crate) version: Option<Spanned<u32>>,
    pub(crate) key: Option<Ident>,
    pub(crate) id_template: Option<Spanned<String>>,
}

/// Where an attribute is written, which decides what it may contain.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Container,
    Variant,
}

const CONTAINER_HELP: &str = "expected one of `topic = \"...\"`, `name = \"...\"`, \
     `version = N`, `key = field`, `id = \"{field}...\"`";
const VARIANT_HELP: &str =
    "expected one of `topic = \"...\"`, `name = \"...\"`, `key = field`, `id = \"{field}...\"`";

fn set_once<T>(cx: &Ctxt, slot: &mut Option<T>, value: T, span: Span, what: &str) {
    if slot.is_some() {
        cx.error(span, format!("duplicate #[outbox({what})] attribute"));
    } else {
        *slot = Some(value);
    }
}

pub(crate) fn container(cx: &Ctxt, attrs: &[Attribute], place: Place) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    for attr in outbox_attrs(attrs) {
        let parsed = attr.parse_nested_meta(|meta| {
            let span = meta.path.get_ident().map_or_else(Span::call_site, Ident::span);
            if meta.path.is_ident("topic") {
                let lit: LitStr = meta.value()?.parse()?;
                let value = Spanned { value: lit.value(), span: lit.span() };
                set_once(cx, &mut out.topic, value, span, "topic");
            } else if meta.path.is_ident("name") {
                let lit: LitStr = meta.value()?.parse()?;
                let value = Spanned { value: lit.value(), span: lit.span() };
                set_once(cx, &mut out.name, value, span, "name");
            } else if meta.path.is_ident("version") && place == Place::Container {
                let lit: LitInt = meta.value()?.parse()?;
                match lit.base10_parse::<u32>() {
                    Ok(v) if v >= 1 => {
                        let value = Spanned { value: v, span: lit.span() };
                        set_once(cx, &mut out.version, value, span, "version");
                    }
                    _ => cx.error(
                        lit.span(),
                        "#[outbox(version)] must be an integer from 1 to 4294967295\n\
                         help: write `#[outbox(version = 2)]`",
                    ),
                }
            } else if meta.path.is_ident("key") {
                let field: Ident = meta.value()?.parse()?;
                set_once(cx, &mut out.key, field, span, "key");
            } else if meta.path.is_ident("id") {
                let Ok(value) = meta.value() else {
                    cx.error(
                        span,
                        "#[outbox(id)] without a template belongs on a field\n\
                         help: mark the field, or write `#[outbox(id = \"{tenant}/{order_id}\")]` here",
                    );
                    return Ok(());
                };
                let lit: LitStr = value.parse()?;
                let value = Spanned { value: lit.value(), span: lit.span() };
                set_once(cx, &mut out.id_template, value, span, "id");
            } else {
                let help = if place == Place::Container { CONTAINER_HELP } else { VARIANT_HELP };
                let path = meta.path.get_ident().map_or_else(|| "?".to_owned(), Ident::to_string);
                // Consume a possible `= value` so parsing goes on to the next item.
                if meta.input.peek(syn::Token![=]) {
                    let _: proc_macro2::TokenStream = meta.value()?.parse()?;
                }
                cx.error(span, format!("unknown outbox attribute `{path}`\nhelp: {help}"));
            }
            Ok(())
        });
        if let Err(e) = parsed {
            cx.push(e);
        }
    }
    out
}

/// Whether a field carries `#[outbox(id)]`; anything else on a field is an error.
pub(crate) fn field_is_id(cx: &Ctxt, attrs: &[Attribute]) -> Option<Span> {
    let mut id = None;
    for attr in outbox_attrs(attrs) {
        let parsed = attr.parse_nested_meta(|meta| {
            let span = meta.path.get_ident().map_or_else(Span::call_site, Ident::span);
            if meta.path.is_ident("id") {
                set_once(cx, &mut id, span, span, "id");
            } else {
                let path = meta.path.get_ident().map_or_else(|| "?".to_owned(), Ident::to_string);
                if meta.input.peek(syn::Token![=]) {
                    let _: proc_macro2::TokenStream = meta.value()?.parse()?;
                }
                cx.error(
                    span,
                    format!("unknown outbox field attribute `{path}`\nhelp: fields take only `#[outbox(id)]`"),
                );
            }
            Ok(())
        });
        if let Err(e) = parsed {
            cx.push(e);
        }
    }
    id
}

fn outbox_attrs(attrs: &[Attribute]) -> impl Iterator<Item = &Attribute> {
    attrs.iter().filter(|a| a.path().is_ident("outbox"))
}
