//! Validation of the model: whether an [`Event`] can become an `OutboxEvent` impl. Every
//! rule that spans attributes, fields and variants lives here, and each mistake is recorded
//! with its span so the user sees all of them at once.

use proc_macro2::Span;
use syn::ext::IdentExt as _;
use syn::spanned::Spanned as _;
use syn::{GenericParam, Ident};

use crate::ast::{Event, IdSource, Origin, Shape, Style, Template, Text, Variant};
use crate::ctxt::Ctxt;

const NO_ID_HELP: &str =
    "`#[outbox(id)] order_id: String`, or `#[outbox(id = \"{tenant}/{order_id}\")]` on the type";

/// Records every reason `event` cannot be derived.
pub(crate) fn check(cx: &Ctxt, event: &Event<'_>) {
    check_generics(cx, event);
    check_text(cx, &event.topic, "topic");
    match event.shape {
        Shape::Struct => {
            for v in &event.variants {
                check_variant(cx, event, v);
            }
        }
        Shape::Enum => {
            if let Some(name) = &event.attrs.name {
                cx.help(
                    name.span,
                    "#[outbox(name)] on an enum names nothing: each variant is its own event type",
                    "put `#[outbox(name = \"...\")]` on the variant",
                );
            }
            if event.variants.is_empty() {
                let span = event.input.ident.span();
                cx.error(span, "an event enum needs at least one variant");
            }
            // A variant already in error is left out, so its name is not also a duplicate.
            let variants: Vec<&Variant<'_>> = event
                .variants
                .iter()
                .filter(|v| check_variant(cx, event, v))
                .collect();
            check_unique_names(cx, &variants);
        }
        Shape::Union(span) => cx.help(
            span,
            "#[derive(OutboxEvent)] does not support unions",
            "use a struct with named fields",
        ),
    }
}

/// Checks one event type; `false` when its shape or id is wrong, after which its other
/// checks would only repeat the mistake.
fn check_variant(cx: &Ctxt, event: &Event<'_>, v: &Variant<'_>) -> bool {
    check_text(cx, &v.topic, "topic");
    if !check_style(cx, event, v) {
        return false;
    }
    check_text(cx, &v.name, "name");
    let of = match v.ident {
        Some(ident) => format!("variant `{ident}`"),
        None => "this event".to_owned(),
    };
    let field_list = v
        .fields
        .iter()
        .map(|f| format!("`{}`", f.unraw()))
        .collect::<Vec<_>>()
        .join(", ");
    let id_ok = match &v.id {
        IdSource::Fields(_) => true,
        IdSource::Template(t) => check_template(cx, t, &of, &field_list),
        IdSource::Both(span) => {
            cx.help(
                *span,
                "an id template and #[outbox(id)] fields both define the id",
                "keep either the template or the #[outbox(id)] fields",
            );
            false
        }
        IdSource::Missing { reported: true } => false,
        IdSource::Missing { reported: false } => {
            let msg = "no msg_id: mark the business key with #[outbox(id)]";
            cx.help(v.span, msg, NO_ID_HELP);
            false
        }
    };
    if !id_ok {
        return false;
    }
    if let Some(k) = &v.key
        && !v.fields.iter().any(|f| f.unraw() == k.unraw())
    {
        let msg = format!("#[outbox(key = {k})] names no field of {of}");
        cx.help(k.span(), msg, format!("the fields are {field_list}"));
    }
    true
}

/// Only named fields can make an id; `false` for a tuple or unit struct or variant.
fn check_style(cx: &Ctxt, event: &Event<'_>, v: &Variant<'_>) -> bool {
    let ident = v.ident.unwrap_or(&event.input.ident).unraw();
    let (what, shown) = match v.ident {
        Some(_) => ("variant", ident.to_string()),
        None => ("struct", format!("struct {ident}")),
    };
    let example = format!("`{shown} {{ #[outbox(id)] order_id: String }}`");
    match v.style {
        Style::Named => return true,
        Style::Tuple(span) => cx.help(
            span,
            format_args!(
                "#[derive(OutboxEvent)] does not support tuple {what}s: \
                 the id is built from named fields"
            ),
            format_args!("name the fields, e.g. {example}"),
        ),
        Style::Unit => cx.help(
            v.span,
            format_args!(
                "#[derive(OutboxEvent)] does not support unit {what}s: \
                 an event needs a field for its id"
            ),
            format_args!("add named fields, e.g. {example}"),
        ),
    }
    false
}

/// Every `{field}` names a field of the event (`of`, with fields `field_list`), the braces
/// balance, and at least one field is named.
fn check_template(cx: &Ctxt, t: &Template, of: &str, field_list: &str) -> bool {
    let mut ok = true;
    let mut named = 0;
    for (name, field) in t.fields() {
        if field.is_some() {
            named += 1;
            continue;
        }
        ok = false;
        if name.is_empty() {
            cx.help(
                t.span,
                "id template has an empty `{}`",
                format_args!("name a field inside the braces; the fields of {of} are {field_list}"),
            );
        } else {
            let msg = format!("id template names `{name}`, which is not a field of {of}");
            cx.help(t.span, msg, format_args!("the fields are {field_list}"));
        }
    }
    if t.unbalanced {
        cx.help(
            t.span,
            "unbalanced brace in id template",
            "write fields as `{field}`, literal braces as `{{` and `}}`",
        );
        return false;
    }
    if ok && named == 0 {
        let help = "`#[outbox(id = \"{tenant}/{order_id}\")]`";
        cx.help(t.span, "id template names no field", help);
        return false;
    }
    ok
}

/// Topics and event names travel in stream keys and `msg_id`s: keep them to `[A-Za-z0-9._-]`.
/// A value taken over from the enum was checked there.
fn check_text(cx: &Ctxt, text: &Text, what: &str) {
    match text.origin {
        Origin::Attr => check_name(cx, &text.value, text.span, what, false),
        // Only fails with non-ASCII identifiers.
        Origin::Ident => check_name(cx, &text.value, text.span, what, true),
        Origin::Inherited => {}
    }
}

/// `derived` is set when the value comes from an identifier rather than an attribute.
fn check_name(cx: &Ctxt, value: &str, span: Span, what: &str, derived: bool) {
    let example = if what == "topic" {
        "order.paid"
    } else {
        "OrderPaid"
    };
    if value.is_empty() {
        let msg = format!("#[outbox({what})] is empty");
        cx.help(
            span,
            msg,
            format!("e.g. `#[outbox({what} = \"{example}\")]`"),
        );
    } else if let Some(c) = value.chars().find(|&c| !allowed(c)) {
        let fixed = suggestion(value, what == "topic");
        let fixed = if fixed.is_empty() { example } else { &fixed };
        let subject = if derived {
            format!("the {what} `{value}`, taken from the identifier,")
        } else {
            format!("#[outbox({what})]")
        };
        cx.help(
            span,
            format!("{subject} contains {c:?}; only `A-Z a-z 0-9 . _ -` are allowed"),
            format!("`#[outbox({what} = \"{fixed}\")]`"),
        );
    }
}

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// `value` with its bad characters as word breaks (a topic) or removed (a name).
fn suggestion(value: &str, topic: bool) -> String {
    if topic {
        let words = value.split(|c: char| c == '.' || !allowed(c));
        words
            .filter(|w| !w.is_empty())
            .collect::<Vec<_>>()
            .join(".")
    } else {
        value.chars().filter(|&c| allowed(c)).collect()
    }
}

/// Two variants with one event type would share `msg_id`s and handlers.
fn check_unique_names(cx: &Ctxt, variants: &[&Variant<'_>]) {
    for (i, v) in variants.iter().enumerate() {
        let Some(first) = variants[..i].iter().find(|w| w.name.value == v.name.value) else {
            continue;
        };
        let (Some(a), Some(b)) = (first.ident, v.ident) else {
            continue;
        };
        cx.help(
            v.name.span,
            format!(
                "duplicate event type `{}`: variants `{a}` and `{b}` would share msg_ids \
                 and handlers",
                v.name.value
            ),
            "give one of them its own `#[outbox(name = \"...\")]`",
        );
    }
}

/// Events must be `DeserializeOwned + 'static`, so they cannot borrow; type parameters are
/// fine.
fn check_generics(cx: &Ctxt, event: &Event<'_>) {
    for param in &event.input.generics.params {
        match param {
            GenericParam::Type(_) => {}
            GenericParam::Lifetime(l) => cx.help(
                l.lifetime.span(),
                "event types cannot borrow: lifetime parameters are not supported",
                "use owned fields (`String`, not `&str`)",
            ),
            GenericParam::Const(c) => cx.help(
                c.span(),
                "const generic parameters are not supported on events",
                const_help(&c.ident),
            ),
        }
    }
}

fn const_help(ident: &Ident) -> String {
    format!("make `{ident}` a field, or give the event a type parameter instead")
}
