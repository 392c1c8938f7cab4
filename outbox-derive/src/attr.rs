//! Parsing of `#[outbox(...)]` attributes. Every mistake is recorded with its span in a
//! [`Ctxt`] so the user sees all of them in one build.

use std::cell::RefCell;

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens as _;
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned as _;
use syn::{Attribute, Ident, LitInt, LitStr, Path, Token};

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
    /// A bare `#[outbox(id)]` was written here; already reported, so "no msg_id" is not.
    pub(crate) misplaced_id: bool,
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
        cx.error(
            span,
            format!("duplicate #[outbox({what})] attribute\nhelp: remove this `{what}`; each attribute is given once"),
        );
    } else {
        *slot = Some(value);
    }
}

/// The value of one `#[outbox(...)]` item.
enum Value {
    /// A bare `word`.
    None,
    /// `word(...)`: a list, which no outbox attribute takes.
    List(TokenStream),
    /// `word = tokens`, the tokens up to the next top-level `,`.
    Eq(TokenStream),
}

/// Consumes the item's value whatever its shape, so that one bad item never hides the
/// items after it (a plain `TokenStream` parse would swallow them all).
fn value(meta: &ParseNestedMeta<'_>) -> syn::Result<Value> {
    if meta.input.peek(syn::token::Paren) {
        let group: TokenTree = meta.input.parse()?;
        return Ok(Value::List(group.into()));
    }
    if !meta.input.peek(Token![=]) {
        return Ok(Value::None);
    }
    let input = meta.value()?;
    let mut tokens = TokenStream::new();
    while !input.is_empty() && !input.peek(Token![,]) {
        tokens.extend([input.parse::<TokenTree>()?]);
    }
    Ok(Value::Eq(tokens))
}

impl Value {
    /// Parses `= <T>`; on anything else records `msg` at the value (or at `path`) and
    /// returns `None`.
    fn parse<T: syn::parse::Parse>(self, cx: &Ctxt, path: &Path, msg: &str) -> Option<T> {
        match self {
            Self::Eq(tokens) => match syn::parse2::<T>(tokens.clone()) {
                Ok(v) => Some(v),
                Err(_) if tokens.is_empty() => {
                    cx.error(path.span(), msg);
                    None
                }
                Err(_) => {
                    cx.push(syn::Error::new_spanned(tokens, msg));
                    None
                }
            },
            Self::List(tokens) => {
                cx.push(syn::Error::new_spanned(tokens, msg));
                None
            }
            Self::None => {
                cx.error(path.span(), msg);
                None
            }
        }
    }
}

fn path_string(path: &Path) -> String {
    path.to_token_stream().to_string().replace(' ', "")
}

fn string(cx: &Ctxt, path: &Path, value: Value, msg: &str) -> Option<Spanned<String>> {
    let lit: LitStr = value.parse(cx, path, msg)?;
    Some(Spanned {
        value: lit.value(),
        span: lit.span(),
    })
}

pub(crate) fn container(cx: &Ctxt, attrs: &[Attribute], place: Place) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    for attr in outbox_attrs(attrs) {
        let parsed = attr.parse_nested_meta(|meta| {
            let path = &meta.path;
            let span = path.span();
            let value = value(&meta)?;
            if path.is_ident("topic") {
                let msg = "#[outbox(topic)] expects a string\nhelp: `#[outbox(topic = \"order.paid\")]`";
                if let Some(v) = string(cx, path, value, msg) {
                    set_once(cx, &mut out.topic, v, span, "topic");
                }
            } else if path.is_ident("name") {
                let msg = "#[outbox(name)] expects a string\nhelp: `#[outbox(name = \"OrderPaid\")]`";
                if let Some(v) = string(cx, path, value, msg) {
                    set_once(cx, &mut out.name, v, span, "name");
                }
            } else if path.is_ident("version") && place == Place::Container {
                let msg = "#[outbox(version)] must be an integer from 1 to 4294967295\n\
                           help: `#[outbox(version = 2)]`";
                let lit: Option<LitInt> = value.parse(cx, path, msg);
                match lit.map(|l| (l.base10_parse::<u32>(), l.span())) {
                    Some((Ok(v), span)) if v >= 1 => {
                        set_once(cx, &mut out.version, Spanned { value: v, span }, path.span(), "version");
                    }
                    Some((_, span)) => cx.error(span, msg),
                    None => {}
                }
            } else if path.is_ident("version") {
                cx.error(
                    span,
                    "#[outbox(version)] belongs on the enum: its variants share one payload schema\n\
                     help: move `version = N` to the enum's #[outbox(...)]",
                );
            } else if path.is_ident("key") {
                if let Value::Eq(tokens) = &value
                    && let Ok(lit) = syn::parse2::<LitStr>(tokens.clone())
                {
                        cx.error(
                            lit.span(),
                            format!(
                                "#[outbox(key)] takes a field name, not a string\n\
                                 help: `#[outbox(key = {})]`",
                                lit.value()
                            ),
                        );
                        return Ok(());
                }
                let msg = "#[outbox(key)] expects a field name\nhelp: `#[outbox(key = customer_id)]`";
                if let Some(field) = value.parse::<Ident>(cx, path, msg) {
                    set_once(cx, &mut out.key, field, span, "key");
                }
            } else if path.is_ident("id") {
                if let Value::None = value {
                    out.misplaced_id = true;
                    cx.error(
                        span,
                        "#[outbox(id)] without a template belongs on a field\n\
                         help: mark the field, or write `#[outbox(id = \"{tenant}/{order_id}\")]` here",
                    );
                    return Ok(());
                }
                let msg = "#[outbox(id)] on a type expects a template string\n\
                           help: `#[outbox(id = \"{tenant}/{order_id}\")]`";
                if let Some(v) = string(cx, path, value, msg) {
                    set_once(cx, &mut out.id_template, v, span, "id");
                }
            } else {
                let help = if place == Place::Container { CONTAINER_HELP } else { VARIANT_HELP };
                let name = path_string(path);
                cx.error(span, format!("unknown outbox attribute `{name}`\nhelp: {help}"));
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
            let span = meta.path.span();
            let value = value(&meta)?;
            if meta.path.is_ident("id") {
                // Still counts as the id, so the mistake does not also cause "no msg_id".
                if !matches!(value, Value::None) {
                    cx.error(
                        span,
                        "#[outbox(id)] on a field takes no value\n\
                         help: write `#[outbox(id)]`, or put a template on the type: \
                         `#[outbox(id = \"{tenant}/{order_id}\")]`",
                    );
                }
                set_once(cx, &mut id, span, span, "id");
            } else {
                let name = path_string(&meta.path);
                cx.error(
                    span,
                    format!("unknown outbox field attribute `{name}`\nhelp: fields take only `#[outbox(id)]`"),
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
