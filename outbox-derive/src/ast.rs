//! The validated model of an event type, built from the parsed attributes.

use proc_macro2::Span;
use syn::{Data, DeriveInput, Fields, GenericParam, Ident, spanned::Spanned as _};

use crate::attr::{self, ContainerAttrs, Ctxt, Place};
use crate::case;

/// An event type: a struct (one variant without a name) or an enum of struct variants.
pub(crate) struct Event<'a> {
    pub(crate) input: &'a DeriveInput,
    pub(crate) version: u32,
    pub(crate) variants: Vec<Variant>,
    pub(crate) is_enum: bool,
}

/// One event type name with its topic, id and ordering key.
pub(crate) struct Variant {
    /// The enum variant; `None` for a struct.
    pub(crate) ident: Option<Ident>,
    pub(crate) name: String,
    pub(crate) topic: String,
    pub(crate) id: Id,
    pub(crate) key: Option<Ident>,
}

/// How the business key is built: a format string and the fields it reads, in order.
pub(crate) struct Id {
    pub(crate) format: String,
    pub(crate) args: Vec<Ident>,
}

impl<'a> Event<'a> {
    pub(crate) fn from_input(input: &'a DeriveInput) -> Result<Self, syn::Error> {
        let cx = Ctxt::default();
        check_generics(&cx, input);
        let top = attr::container(&cx, &input.attrs, Place::Container);
        let type_name = input.ident.to_string();
        let default_topic = top
            .topic
            .as_ref()
            .map_or_else(|| case::dotted(&type_name), |t| t.value.clone());
        if let Some(t) = &top.topic {
            check_name(&cx, &t.value, t.span, "topic");
        }
        let version = top.version.as_ref().map_or(1, |v| v.value);
        let (variants, is_enum) = match &input.data {
            Data::Struct(s) => {
                let variant = variant(
                    &cx,
                    None,
                    &s.fields,
                    input.ident.span(),
                    &top,
                    &top,
                    &type_name,
                    &default_topic,
                );
                (variant.into_iter().collect(), false)
            }
            Data::Enum(e) => {
                if let Some(name) = &top.name {
                    cx.error(name.span, "#[outbox(name)] on an enum names nothing: each variant is its own event type\nhelp: put `#[outbox(name = \"...\")]` on the variant");
                }
                if e.variants.is_empty() {
                    cx.error(
                        input.ident.span(),
                        "an event enum needs at least one variant",
                    );
                }
                let variants = e.variants.iter().filter_map(|v| {
                    let own = attr::container(&cx, &v.attrs, Place::Variant);
                    if let Some(t) = &own.topic {
                        check_name(&cx, &t.value, t.span, "topic");
                    }
                    let topic = own
                        .topic
                        .as_ref()
                        .map_or_else(|| default_topic.clone(), |t| t.value.clone());
                    variant(
                        &cx,
                        Some(&v.ident),
                        &v.fields,
                        v.ident.span(),
                        &own,
                        &top,
                        &v.ident.to_string(),
                        &topic,
                    )
                });
                (variants.collect(), true)
            }
            Data::Union(u) => {
                cx.error(u.union_token.span, "#[derive(OutboxEvent)] does not support unions\nhelp: use a struct with named fields");
                (Vec::new(), false)
            }
        };
        cx.finish()?;
        Ok(Self {
            input,
            version,
            variants,
            is_enum,
        })
    }
}

/// Builds one event type; `own` are its attributes, `top` the container's (an enum's
/// variants inherit its `id` template and `key`).
#[allow(clippy::too_many_arguments)] // reason: one call per shape; a struct of these reads worse
fn variant(
    cx: &Ctxt,
    ident: Option<&Ident>,
    fields: &Fields,
    span: Span,
    own: &ContainerAttrs,
    top: &ContainerAttrs,
    default_name: &str,
    topic: &str,
) -> Option<Variant> {
    let Fields::Named(named) = fields else {
        let what = if ident.is_some() {
            "tuple and unit variants"
        } else {
            "tuple and unit structs"
        };
        cx.error(fields.span().join(span).unwrap_or(span), format!(
            "#[derive(OutboxEvent)] does not support {what}: the id is built from named fields\nhelp: use named fields, e.g. `{{ #[outbox(id)] order_id: String }}`"
        ));
        return None;
    };
    let names: Vec<Ident> = named.named.iter().filter_map(|f| f.ident.clone()).collect();
    let id_fields: Vec<(Ident, Span)> = named
        .named
        .iter()
        .filter_map(|f| {
            attr::field_is_id(cx, &f.attrs).map(|s| (f.ident.clone().expect("named field"), s))
        })
        .collect();
    let name = own
        .name
        .as_ref()
        .map_or_else(|| default_name.to_owned(), |n| n.value.clone());
    if let Some(n) = &own.name {
        check_name(cx, &n.value, n.span, "name");
    }
    let template = own.id_template.as_ref().or(top.id_template.as_ref());
    let id = match (template, id_fields.is_empty()) {
        (Some(t), true) => parse_template(cx, t, &names)?,
        (Some(t), false) => {
            cx.error(t.span, "an id template and #[outbox(id)] fields both define the id\nhelp: keep one of them");
            return None;
        }
        (None, false) => Id {
            format: vec!["{}"; id_fields.len()].join(":"),
            args: id_fields.into_iter().map(|(f, _)| f).collect(),
        },
        (None, true) => {
            cx.error(span, "no msg_id: mark the business key with #[outbox(id)]\nhelp: `#[outbox(id)] order_id: String`, or `#[outbox(id = \"{tenant}/{order_id}\")]` on the type");
            return None;
        }
    };
    let key = own.key.as_ref().or(top.key.as_ref()).cloned();
    if let Some(k) = &key {
        if !names.contains(k) {
            cx.error(
                k.span(),
                format!("#[outbox(key = {k})] names no field of this event"),
            );
        }
    }
    Some(Variant {
        ident: ident.cloned(),
        name,
        topic: topic.to_owned(),
        id,
        key,
    })
}

/// `"{tenant}/{order_id}"` → format `"{}/{}"` with args `tenant, order_id`.
fn parse_template(cx: &Ctxt, t: &attr::Spanned<String>, fields: &[Ident]) -> Option<Id> {
    let mut format = String::new();
    let mut args = Vec::new();
    let mut rest = t.value.as_str();
    let mut ok = true;
    while let Some(open) = rest.find(['{', '}']) {
        let (before, after) = rest.split_at(open);
        format.push_str(before);
        if let Some(tail) = after
            .strip_prefix("{{")
            .or_else(|| after.strip_prefix("}}"))
        {
            format.push_str(&after[..2]);
            rest = tail;
            continue;
        }
        let Some(close) = after.find('}').filter(|_| after.starts_with('{')) else {
            cx.error(t.span, "unbalanced brace in id template\nhelp: write fields as `{field}`, literal braces as `{{` and `}}`");
            return None;
        };
        let field = &after[1..close];
        match fields.iter().find(|f| *f == field) {
            Some(f) => args.push(f.clone()),
            None => {
                cx.error(
                    t.span,
                    format!("id template names `{field}`, which is not a field of this event"),
                );
                ok = false;
            }
        }
        format.push_str("{}");
        rest = &after[close + 1..];
    }
    format.push_str(rest);
    if args.is_empty() && ok {
        cx.error(
            t.span,
            "id template names no field\nhelp: `#[outbox(id = \"{tenant}/{order_id}\")]`",
        );
        return None;
    }
    ok.then_some(Id { format, args })
}

/// Topics and event names travel in stream keys and msg_ids: keep them to `[A-Za-z0-9._-]`.
fn check_name(cx: &Ctxt, value: &str, span: Span, what: &str) {
    if value.is_empty() {
        cx.error(
            span,
            format!("#[outbox({what})] is empty\nhelp: e.g. `#[outbox({what} = \"order.paid\")]`"),
        );
    } else if let Some(c) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        cx.error(
            span,
            format!("#[outbox({what})] contains {c:?}; only `A-Z a-z 0-9 . _ -` are allowed"),
        );
    }
}

/// Events must be `DeserializeOwned + 'static`: lifetimes cannot be supported, nor const
/// generics in the generated `msg_id_for`; type parameters are fine.
fn check_generics(cx: &Ctxt, input: &DeriveInput) {
    for param in &input.generics.params {
        match param {
            GenericParam::Type(_) => {}
            GenericParam::Lifetime(l) => cx.error(l.lifetime.span(), "event types cannot borrow: lifetime parameters are not supported\nhelp: use owned fields (`String`, not `&str`)"),
            GenericParam::Const(c) => cx.error(c.ident.span(), "const generic parameters are not supported on events"),
        }
    }
}
