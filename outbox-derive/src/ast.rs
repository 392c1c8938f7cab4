//! The validated model of an event type, built from the parsed attributes.

use proc_macro2::Span;
use syn::ext::IdentExt as _;
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
    /// Where the name comes from: `#[outbox(name = "...")]` or the variant's identifier.
    pub(crate) name_span: Span,
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
        let type_name = input.ident.unraw().to_string();
        let default_topic = top
            .topic
            .as_ref()
            .map_or_else(|| case::dotted(&type_name), |t| t.value.clone());
        match &top.topic {
            Some(t) => check_name(&cx, &t.value, t.span, "topic", false),
            // Only reachable with non-ASCII identifiers.
            None => check_name(&cx, &default_topic, input.ident.span(), "topic", true),
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
                        check_name(&cx, &t.value, t.span, "topic", false);
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
                        &v.ident.unraw().to_string(),
                        &topic,
                    )
                });
                let variants: Vec<Variant> = variants.collect();
                check_unique_names(&cx, &variants);
                (variants, true)
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
    let what = if ident.is_some() { "variant" } else { "struct" };
    let shown = match ident {
        Some(_) => default_name.to_owned(),
        None => format!("struct {default_name}"),
    };
    let named = match fields {
        Fields::Named(named) => named,
        Fields::Unnamed(unnamed) => {
            cx.error(unnamed.paren_token.span.join(), format!(
                "#[derive(OutboxEvent)] does not support tuple {what}s: the id is built from named fields\n\
                 help: name the fields, e.g. `{shown} {{ #[outbox(id)] order_id: String }}`"
            ));
            return None;
        }
        Fields::Unit => {
            cx.error(span, format!(
                "#[derive(OutboxEvent)] does not support unit {what}s: an event needs a field for its id\n\
                 help: add named fields, e.g. `{shown} {{ #[outbox(id)] order_id: String }}`"
            ));
            return None;
        }
    };
    let names: Vec<Ident> = named.named.iter().filter_map(|f| f.ident.clone()).collect();
    let id_fields: Vec<Ident> = named
        .named
        .iter()
        .filter_map(|f| {
            attr::field_is_id(cx, &f.attrs).map(|_| f.ident.clone().expect("named field"))
        })
        .collect();
    let (name, name_span) = match &own.name {
        Some(n) => {
            check_name(cx, &n.value, n.span, "name", false);
            (n.value.clone(), n.span)
        }
        None => {
            // Only reachable with non-ASCII identifiers.
            check_name(cx, default_name, span, "name", true);
            (default_name.to_owned(), span)
        }
    };
    let of = match ident {
        Some(v) => format!("variant `{v}`"),
        None => "this event".to_owned(),
    };
    let field_list = names
        .iter()
        .map(|f| format!("`{}`", f.unraw()))
        .collect::<Vec<_>>()
        .join(", ");
    // A variant's own template or id fields replace the enum's template.
    let template = match (&own.id_template, id_fields.is_empty()) {
        (Some(t), _) => Some(t),
        (None, true) => top.id_template.as_ref(),
        (None, false) => None,
    };
    let id = match (template, id_fields.is_empty()) {
        (Some(t), true) => parse_template(cx, t, &names, &of, &field_list)?,
        (Some(t), false) => {
            cx.error(
                t.span,
                "an id template and #[outbox(id)] fields both define the id\n\
                 help: keep either the template or the #[outbox(id)] fields",
            );
            return None;
        }
        (None, false) => Id {
            format: vec!["{}"; id_fields.len()].join(":"),
            args: id_fields,
        },
        (None, true) if own.misplaced_id || top.misplaced_id => return None,
        (None, true) => {
            cx.error(span, "no msg_id: mark the business key with #[outbox(id)]\nhelp: `#[outbox(id)] order_id: String`, or `#[outbox(id = \"{tenant}/{order_id}\")]` on the type");
            return None;
        }
    };
    let key = own.key.as_ref().or(top.key.as_ref()).cloned();
    if let Some(k) = &key
        && !names.iter().any(|f| f.unraw() == k.unraw())
    {
        cx.error(
            k.span(),
            format!(
                "#[outbox(key = {k})] names no field of {of}\nhelp: the fields are {field_list}"
            ),
        );
    }
    Some(Variant {
        ident: ident.cloned(),
        name,
        name_span,
        topic: topic.to_owned(),
        id,
        key,
    })
}

/// `"{tenant}/{order_id}"` → format `"{}/{}"` with args `tenant, order_id`. `of` names the
/// event in messages ("this event", "variant `Paid`"); `field_list` lists its fields.
fn parse_template(
    cx: &Ctxt,
    t: &attr::Spanned<String>,
    fields: &[Ident],
    of: &str,
    field_list: &str,
) -> Option<Id> {
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
        let close = after
            .find('}')
            .filter(|&close| after.starts_with('{') && !after[1..close].contains('{'));
        let Some(close) = close else {
            cx.error(t.span, "unbalanced brace in id template\nhelp: write fields as `{field}`, literal braces as `{{` and `}}`");
            return None;
        };
        let field = &after[1..close];
        match fields.iter().find(|f| f.unraw() == field) {
            Some(f) => args.push(f.clone()),
            None if field.is_empty() => {
                cx.error(
                    t.span,
                    format!("id template has an empty `{{}}`\nhelp: name a field inside the braces; the fields of {of} are {field_list}"),
                );
                ok = false;
            }
            None => {
                cx.error(
                    t.span,
                    format!("id template names `{field}`, which is not a field of {of}\nhelp: the fields are {field_list}"),
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
/// `derived` is set when the value comes from an identifier rather than an attribute.
fn check_name(cx: &Ctxt, value: &str, span: Span, what: &str, derived: bool) {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let example = if what == "topic" {
        "order.paid"
    } else {
        "OrderPaid"
    };
    if value.is_empty() {
        cx.error(
            span,
            format!("#[outbox({what})] is empty\nhelp: e.g. `#[outbox({what} = \"{example}\")]`"),
        );
    } else if let Some(c) = value.chars().find(|&c| !allowed(c)) {
        // The suggestion: bad characters become word breaks in a topic and vanish in a name.
        let fixed: String = if what == "topic" {
            value
                .split(|c: char| c == '.' || !allowed(c))
                .filter(|w| !w.is_empty())
                .collect::<Vec<_>>()
                .join(".")
        } else {
            value.chars().filter(|&c| allowed(c)).collect()
        };
        let fixed = if fixed.is_empty() { example } else { &fixed };
        let subject = if derived {
            format!("the {what} `{value}`, taken from the identifier,")
        } else {
            format!("#[outbox({what})]")
        };
        cx.error(
            span,
            format!(
                "{subject} contains {c:?}; only `A-Z a-z 0-9 . _ -` are allowed\n\
                 help: `#[outbox({what} = \"{fixed}\")]`"
            ),
        );
    }
}

/// Two variants with one event type would share msg_ids and handlers.
fn check_unique_names(cx: &Ctxt, variants: &[Variant]) {
    for (i, v) in variants.iter().enumerate() {
        if let Some(first) = variants[..i].iter().find(|w| w.name == v.name) {
            let (a, b) = (
                first.ident.as_ref().expect("enum variant"),
                v.ident.as_ref().expect("enum variant"),
            );
            cx.error(
                v.name_span,
                format!(
                    "duplicate event type `{}`: variants `{a}` and `{b}` would share msg_ids and handlers\n\
                     help: give one of them its own `#[outbox(name = \"...\")]`",
                    v.name
                ),
            );
        }
    }
}

/// Events must be `DeserializeOwned + 'static`, so they cannot borrow; type parameters are
/// fine.
fn check_generics(cx: &Ctxt, input: &DeriveInput) {
    for param in &input.generics.params {
        match param {
            GenericParam::Type(_) => {}
            GenericParam::Lifetime(l) => cx.error(l.lifetime.span(), "event types cannot borrow: lifetime parameters are not supported\nhelp: use owned fields (`String`, not `&str`)"),
            GenericParam::Const(c) => cx.error(c.span(), format!(
                "const generic parameters are not supported on events\n\
                 help: make `{}` a field, or give the event a type parameter instead",
                c.ident
            )),
        }
    }
}
