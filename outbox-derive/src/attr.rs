//! Parsing of `#[outbox(...)]` attributes into plain values. Mistakes in an attribute's own
//! syntax (unknown item, wrong value type, duplicate) are recorded here; whether the values
//! make a valid event is `valid`'s business.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens as _;
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned as _;
use syn::{Attribute, Ident, LitInt, LitStr, Path, Token};

use crate::ctxt::Ctxt;

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
    /// `partitions = N`: how many partition streams each of the type's topics has.
    pub(crate) partitions: Option<Spanned<u32>>,
    pub(crate) key: Option<Ident>,
    pub(crate) id_template: Option<Spanned<String>>,
    /// `crate = "path"`: how generated code names `outbox-core`.
    pub(crate) krate: Option<Path>,
    /// A bare `#[outbox(id)]` was written here; already reported, so "no `msg_id`" is not.
    pub(crate) misplaced_id: bool,
}

/// Where an attribute is written, which decides what it may contain.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Container,
    Variant,
}

const CONTAINER_HELP: &str = "expected one of `topic = \"...\"`, `name = \"...\"`, \
     `version = N`, `partitions = N`, `key = field`, `id = \"{field}...\"`, `crate = \"path\"`";
const VARIANT_HELP: &str =
    "expected one of `topic = \"...\"`, `name = \"...\"`, `key = field`, `id = \"{field}...\"`";

const TOPIC_EXPECTED: &str =
    "#[outbox(topic)] expects a string\nhelp: `#[outbox(topic = \"order.paid\")]`";
const NAME_EXPECTED: &str =
    "#[outbox(name)] expects a string\nhelp: `#[outbox(name = \"OrderPaid\")]`";
const VERSION_EXPECTED: &str = "#[outbox(version)] must be an integer from 1 to 4294967295\n\
     help: `#[outbox(version = 2)]`";
/// The most partitions a topic may have: `outbox_core::MAX_PARTITIONS`, which this crate
/// cannot name (the facade depends on it). `outbox-core/tests/derive.rs` checks the two agree.
const MAX_PARTITIONS: u32 = 1024;
const PARTITIONS_EXPECTED: &str = "#[outbox(partitions)] must be an integer from 1 to 1024\n\
     help: `#[outbox(partitions = 8)]`";
const KEY_EXPECTED: &str =
    "#[outbox(key)] expects a field name\nhelp: `#[outbox(key = customer_id)]`";
const ID_EXPECTED: &str = "#[outbox(id)] on a type expects a template string\n\
     help: `#[outbox(id = \"{tenant}/{order_id}\")]`";
const CRATE_EXPECTED: &str = "#[outbox(crate)] expects a path to `outbox_core` in a string\n\
     help: `#[outbox(crate = \"my_app::outbox\")]`";

/// Records a duplicate instead of overwriting the first value.
fn set_once<T>(cx: &Ctxt, slot: &mut Option<T>, value: T, span: Span, what: &str) {
    if slot.is_some() {
        let msg = format!("duplicate #[outbox({what})] attribute");
        cx.help(
            span,
            msg,
            format!("remove this `{what}`; each attribute is given once"),
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
        let tokens = match self {
            Self::Eq(tokens) if tokens.is_empty() => None,
            Self::Eq(tokens) => match syn::parse2::<T>(tokens.clone()) {
                Ok(v) => return Some(v),
                Err(_) => Some(tokens),
            },
            Self::List(tokens) => Some(tokens),
            Self::None => None,
        };
        match tokens {
            Some(tokens) => cx.push(syn::Error::new_spanned(tokens, msg)),
            None => cx.error(path.span(), msg),
        }
        None
    }

    /// Parses `= "..."`.
    fn string(self, cx: &Ctxt, path: &Path, msg: &str) -> Option<Spanned<String>> {
        let lit: LitStr = self.parse(cx, path, msg)?;
        Some(Spanned {
            value: lit.value(),
            span: lit.span(),
        })
    }
}

fn path_string(path: &Path) -> String {
    path.to_token_stream().to_string().replace(' ', "")
}

/// Parses every `#[outbox(...)]` of a struct, enum or variant.
pub(crate) fn container(cx: &Ctxt, attrs: &[Attribute], place: Place) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    for attr in outbox_attrs(attrs) {
        let parsed = attr.parse_nested_meta(|meta| {
            let value = value(&meta)?;
            container_item(cx, &mut out, &meta.path, value, place);
            Ok(())
        });
        if let Err(e) = parsed {
            cx.push(e);
        }
    }
    out
}

/// One `word = value` item of a container attribute.
fn container_item(cx: &Ctxt, out: &mut ContainerAttrs, path: &Path, value: Value, place: Place) {
    let span = path.span();
    let on_type = place == Place::Container;
    if path.is_ident("topic") {
        if let Some(v) = value.string(cx, path, TOPIC_EXPECTED) {
            set_once(cx, &mut out.topic, v, span, "topic");
        }
    } else if path.is_ident("name") {
        if let Some(v) = value.string(cx, path, NAME_EXPECTED) {
            set_once(cx, &mut out.name, v, span, "name");
        }
    } else if path.is_ident("version") && on_type {
        if let Some(v) = version(cx, path, value) {
            set_once(cx, &mut out.version, v, span, "version");
        }
    } else if path.is_ident("partitions") && on_type {
        if let Some(v) = partitions(cx, path, value) {
            set_once(cx, &mut out.partitions, v, span, "partitions");
        }
    } else if path.is_ident("key") {
        if let Some(field) = key(cx, path, value) {
            set_once(cx, &mut out.key, field, span, "key");
        }
    } else if path.is_ident("id") {
        if let Value::None = value {
            out.misplaced_id = true;
            cx.help(
                span,
                "#[outbox(id)] without a template belongs on a field",
                "mark the field, or write `#[outbox(id = \"{tenant}/{order_id}\")]` here",
            );
        } else if let Some(v) = value.string(cx, path, ID_EXPECTED) {
            set_once(cx, &mut out.id_template, v, span, "id");
        }
    } else if path.is_ident("crate") && on_type {
        if let Some(krate) = krate(cx, path, value) {
            set_once(cx, &mut out.krate, krate, span, "crate");
        }
    } else if ["version", "partitions", "crate"]
        .iter()
        .any(|name| path.is_ident(name))
    {
        misplaced_on_variant(cx, path);
    } else {
        let help = if on_type {
            CONTAINER_HELP
        } else {
            VARIANT_HELP
        };
        let name = path_string(path);
        cx.help(span, format!("unknown outbox attribute `{name}`"), help);
    }
}

/// `version = N`, N from 1.
fn version(cx: &Ctxt, path: &Path, value: Value) -> Option<Spanned<u32>> {
    let lit: LitInt = value.parse(cx, path, VERSION_EXPECTED)?;
    match lit.base10_parse::<u32>() {
        Ok(value) if value >= 1 => Some(Spanned {
            value,
            span: lit.span(),
        }),
        _ => {
            cx.error(lit.span(), VERSION_EXPECTED);
            None
        }
    }
}

/// `partitions = N`, N from 1 to [`MAX_PARTITIONS`]; the error points at the value.
fn partitions(cx: &Ctxt, path: &Path, value: Value) -> Option<Spanned<u32>> {
    let lit: LitInt = value.parse(cx, path, PARTITIONS_EXPECTED)?;
    match lit.base10_parse::<u32>() {
        Ok(value) if (1..=MAX_PARTITIONS).contains(&value) => Some(Spanned {
            value,
            span: lit.span(),
        }),
        _ => {
            cx.error(lit.span(), PARTITIONS_EXPECTED);
            None
        }
    }
}

/// `key = field`; a string (`key = "field"`) gets its own hint.
fn key(cx: &Ctxt, path: &Path, value: Value) -> Option<Ident> {
    if let Value::Eq(tokens) = &value
        && let Ok(lit) = syn::parse2::<LitStr>(tokens.clone())
    {
        let help = format!("`#[outbox(key = {})]`", lit.value());
        cx.help(
            lit.span(),
            "#[outbox(key)] takes a field name, not a string",
            help,
        );
        return None;
    }
    value.parse(cx, path, KEY_EXPECTED)
}

/// `crate = "path"`, a module-style path (`::a::b`, `crate::a`, no generics). Its tokens
/// carry the string's span, so a path that does not resolve is reported at the string.
fn krate(cx: &Ctxt, path: &Path, value: Value) -> Option<Path> {
    let lit: LitStr = value.parse(cx, path, CRATE_EXPECTED)?;
    match lit.parse_with(Path::parse_mod_style) {
        Ok(krate) => Some(krate),
        Err(_) => {
            cx.error(lit.span(), CRATE_EXPECTED);
            None
        }
    }
}

/// `version`, `partitions` and `crate` hold for the whole enum, not for one variant.
fn misplaced_on_variant(cx: &Ctxt, path: &Path) {
    let (what, why, example) = if path.is_ident("version") {
        (
            "version",
            "its variants share one payload schema",
            "version = N",
        )
    } else if path.is_ident("partitions") {
        (
            "partitions",
            "one partition count holds for every topic of the type",
            "partitions = N",
        )
    } else {
        ("crate", "its variants share one impl", "crate = \"...\"")
    };
    cx.help(
        path.span(),
        format!("#[outbox({what})] belongs on the enum: {why}"),
        format!("move `{example}` to the enum's #[outbox(...)]"),
    );
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
                    field_id_with_value(cx, span);
                }
                set_once(cx, &mut id, span, span, "id");
            } else {
                let name = path_string(&meta.path);
                let msg = format!("unknown outbox field attribute `{name}`");
                cx.help(span, msg, "fields take only `#[outbox(id)]`");
            }
            Ok(())
        });
        if let Err(e) = parsed {
            cx.push(e);
        }
    }
    id
}

fn field_id_with_value(cx: &Ctxt, span: Span) {
    cx.help(
        span,
        "#[outbox(id)] on a field takes no value",
        "write `#[outbox(id)]`, or put a template on the type: \
         `#[outbox(id = \"{tenant}/{order_id}\")]`",
    );
}

fn outbox_attrs(attrs: &[Attribute]) -> impl Iterator<Item = &Attribute> {
    attrs.iter().filter(|a| a.path().is_ident("outbox"))
}
