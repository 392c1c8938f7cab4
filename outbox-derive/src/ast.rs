//! The model of an event type: what the type and its `#[outbox(...)]` attributes say, with
//! the defaults and the enum-to-variant inheritance applied. Building it reports nothing
//! beyond the attributes' own syntax; `valid` decides whether the model is an event.

use proc_macro2::Span;
use syn::ext::IdentExt as _;
use syn::{Data, DeriveInput, Fields, Ident, Path};

use crate::attr::{self, ContainerAttrs, Place, Spanned};
use crate::case;
use crate::ctxt::Ctxt;

/// An event type: a struct (one variant without a name) or an enum of variants.
pub(crate) struct Event<'a> {
    pub(crate) input: &'a DeriveInput,
    /// The attributes on the type itself.
    pub(crate) attrs: ContainerAttrs,
    pub(crate) shape: Shape,
    /// The enum's or struct's topic, inherited by variants that set none.
    pub(crate) topic: Text,
    pub(crate) version: u32,
    /// `#[outbox(partitions = N)]`; `None` keeps the trait's default (one stream a topic).
    pub(crate) partitions: Option<u32>,
    /// `#[outbox(crate = "...")]`: the path generated code reaches `outbox-core` by, in
    /// place of `::outbox_core`.
    pub(crate) krate: Option<Path>,
    /// The crate reached without `crate = "..."`: `outbox_core`, or `outbox` for the
    /// derive the `typed-outbox` facade re-exports.
    pub(crate) default_krate: &'static str,
    /// A struct's single variant, or an enum's variants; empty for a union.
    pub(crate) variants: Vec<Variant<'a>>,
}

/// What the derive was applied to.
pub(crate) enum Shape {
    Struct,
    Enum,
    /// Unsupported; the span of the `union` keyword.
    Union(Span),
}

/// A topic or event name, and where it comes from (which decides how it is checked).
#[derive(Clone)]
pub(crate) struct Text {
    pub(crate) value: String,
    pub(crate) span: Span,
    pub(crate) origin: Origin,
}

/// Where a [`Text`] comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Written in an attribute.
    Attr,
    /// Derived from the type's or variant's identifier.
    Ident,
    /// The enum's topic, taken over by a variant; checked where it was set.
    Inherited,
}

/// One event type (a struct, or one variant of an enum) with its topic, id and ordering key.
pub(crate) struct Variant<'a> {
    /// The enum variant; `None` for a struct.
    pub(crate) ident: Option<&'a Ident>,
    /// The identifier of the variant (or struct), where errors about it as a whole point.
    pub(crate) span: Span,
    pub(crate) style: Style,
    /// The named fields; empty for tuple and unit shapes.
    pub(crate) fields: Vec<&'a Ident>,
    pub(crate) name: Text,
    pub(crate) topic: Text,
    pub(crate) id: IdSource,
    /// `key = field`, the variant's own or else the enum's.
    pub(crate) key: Option<Ident>,
}

/// The fields' form. Only named fields can make an id.
pub(crate) enum Style {
    Named,
    /// The span of the parentheses.
    Tuple(Span),
    Unit,
}

/// Where the business key comes from.
pub(crate) enum IdSource {
    /// Fields marked `#[outbox(id)]`, in declaration order.
    Fields(Vec<Ident>),
    /// An id template, the variant's own or else the enum's.
    Template(Template),
    /// The variant has both its own template (span) and `#[outbox(id)]` fields.
    Both(Span),
    /// Neither. `reported` when a bare `#[outbox(id)]` on the type was already reported,
    /// so "no `msg_id`" would only repeat it.
    Missing { reported: bool },
}

/// An id template split into text and `{field}` references.
pub(crate) struct Template {
    pub(crate) span: Span,
    pub(crate) pieces: Vec<Piece>,
    /// A `{` or `}` was left open; `pieces` holds what came before it.
    pub(crate) unbalanced: bool,
}

/// A part of a [`Template`].
pub(crate) enum Piece {
    /// Text for `format!`, literal braces still doubled.
    Text(String),
    /// A `{name}`, with the field it names if the variant has one.
    Field(String, Option<Ident>),
}

/// How the business key is built: a format string and the fields it reads, in order.
pub(crate) struct Id {
    pub(crate) format: String,
    pub(crate) args: Vec<Ident>,
}

impl<'a> Event<'a> {
    /// The model of `input`; attribute syntax errors go to `cx`.
    pub(crate) fn from_input(cx: &Ctxt, input: &'a DeriveInput) -> Self {
        let attrs = attr::container(cx, &input.attrs, Place::Container);
        let ident = &input.ident;
        let topic = match &attrs.topic {
            Some(t) => Text::attr(t),
            None => Text::ident(case::dotted(&ident.unraw().to_string()), ident.span()),
        };
        let version = attrs.version.as_ref().map_or(1, |v| v.value);
        let partitions = attrs.partitions.as_ref().map(|p| p.value);
        let krate = attrs.krate.clone();
        let mut event = Self {
            input,
            attrs,
            shape: Shape::Struct,
            topic,
            version,
            partitions,
            krate,
            default_krate: "outbox_core",
            variants: Vec::new(),
        };
        match &input.data {
            Data::Struct(s) => {
                let variant = Variant::new(cx, &event, None, ident, &s.fields);
                event.variants.push(variant);
            }
            Data::Enum(e) => {
                event.shape = Shape::Enum;
                for v in &e.variants {
                    let own = attr::container(cx, &v.attrs, Place::Variant);
                    let variant = Variant::new(cx, &event, Some(&own), &v.ident, &v.fields);
                    event.variants.push(variant);
                }
            }
            Data::Union(u) => event.shape = Shape::Union(u.union_token.span),
        }
        event
    }
}

impl<'a> Variant<'a> {
    /// A struct, whose attributes are the type's (`own` is `None`), or an enum variant
    /// with its own attributes.
    fn new(
        cx: &Ctxt,
        event: &Event<'_>,
        own: Option<&ContainerAttrs>,
        ident: &'a Ident,
        fields: &'a Fields,
    ) -> Self {
        let (style, named) = match fields {
            Fields::Named(named) => (Style::Named, Some(named)),
            Fields::Unnamed(unnamed) => (Style::Tuple(unnamed.paren_token.span.join()), None),
            Fields::Unit => (Style::Unit, None),
        };
        // Tuple and unit shapes are rejected as a whole; their field attributes go unread.
        let named: Vec<&'a syn::Field> = named.iter().flat_map(|n| &n.named).collect();
        let id_fields = named
            .iter()
            .filter(|f| attr::field_is_id(cx, &f.attrs).is_some())
            .filter_map(|f| f.ident.clone())
            .collect();
        let fields: Vec<&'a Ident> = named.iter().filter_map(|f| f.ident.as_ref()).collect();
        let top = &event.attrs;
        let is_variant = own.is_some();
        let attrs = own.unwrap_or(top);
        let name = match &attrs.name {
            Some(n) => Text::attr(n),
            None => Text::ident(ident.unraw().to_string(), ident.span()),
        };
        let topic = match own.and_then(|a| a.topic.as_ref()) {
            Some(t) => Text::attr(t),
            None => Text {
                origin: Origin::Inherited,
                ..event.topic.clone()
            },
        };
        Self {
            ident: is_variant.then_some(ident),
            span: ident.span(),
            style,
            name,
            topic,
            id: IdSource::new(attrs, top, id_fields, &fields),
            key: attrs.key.as_ref().or(top.key.as_ref()).cloned(),
            fields,
        }
    }

    /// The business key's format string and arguments. Only a `Fields` or `Template` id
    /// builds one; `valid` rejects the others before anything is generated.
    pub(crate) fn id(&self) -> Id {
        match &self.id {
            IdSource::Fields(fields) => Id {
                format: vec!["{}"; fields.len()].join(":"),
                args: fields.clone(),
            },
            IdSource::Template(t) => t.id(),
            IdSource::Both(_) | IdSource::Missing { .. } => Id {
                format: String::new(),
                args: Vec::new(),
            },
        }
    }
}

impl Text {
    fn attr(value: &Spanned<String>) -> Self {
        Self {
            value: value.value.clone(),
            span: value.span,
            origin: Origin::Attr,
        }
    }

    fn ident(value: String, span: Span) -> Self {
        Self {
            value,
            span,
            origin: Origin::Ident,
        }
    }
}

impl IdSource {
    /// `own` are the variant's attributes (a struct's are the type's), `top` the type's.
    /// A variant's own template or id fields replace the enum's template.
    fn new(own: &ContainerAttrs, top: &ContainerAttrs, ids: Vec<Ident>, fields: &[&Ident]) -> Self {
        let template = match &own.id_template {
            Some(t) => Some(t),
            None if ids.is_empty() => top.id_template.as_ref(),
            None => None,
        };
        match (template, ids.is_empty()) {
            (Some(t), true) => Self::Template(Template::parse(t, fields)),
            (Some(t), false) => Self::Both(t.span),
            (None, false) => Self::Fields(ids),
            (None, true) => Self::Missing {
                reported: own.misplaced_id || top.misplaced_id,
            },
        }
    }
}

impl Template {
    /// `"{tenant}/{order_id}"` → text `""`, field `tenant`, text `"/"`, field `order_id`.
    /// `{{` and `}}` are literal braces; a field name is matched against `fields`.
    fn parse(t: &Spanned<String>, fields: &[&Ident]) -> Self {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut rest = t.value.as_str();
        let mut unbalanced = false;
        while let Some(open) = rest.find(['{', '}']) {
            let (before, after) = rest.split_at(open);
            text.push_str(before);
            if after.starts_with("{{") || after.starts_with("}}") {
                text.push_str(&after[..2]);
                rest = &after[2..];
                continue;
            }
            let Some(close) = field_end(after) else {
                unbalanced = true;
                break;
            };
            let name = &after[1..close];
            let field = fields.iter().find(|f| f.unraw() == name);
            pieces.push(Piece::Text(std::mem::take(&mut text)));
            pieces.push(Piece::Field(name.to_owned(), field.map(|&f| f.clone())));
            rest = &after[close + 1..];
        }
        if !unbalanced {
            text.push_str(rest);
        }
        pieces.push(Piece::Text(text));
        Self {
            span: t.span,
            pieces,
            unbalanced,
        }
    }

    /// The fields named, in order.
    pub(crate) fn fields(&self) -> impl Iterator<Item = (&str, Option<&Ident>)> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Text(_) => None,
            Piece::Field(name, ident) => Some((name.as_str(), ident.as_ref())),
        })
    }

    fn id(&self) -> Id {
        let mut format = String::new();
        for piece in &self.pieces {
            format.push_str(match piece {
                Piece::Text(text) => text,
                Piece::Field(..) => "{}",
            });
        }
        let args = self.fields().filter_map(|(_, f)| f.cloned()).collect();
        Id { format, args }
    }
}

/// Where the `{field}` at the start of `s` closes: the first `}`, if `s` opens with `{`
/// and no other `{` comes first.
fn field_end(s: &str) -> Option<usize> {
    let close = s.find('}')?;
    (s.starts_with('{') && !s[1..close].contains('{')).then_some(close)
}
