//! Code generation. Paths are fully qualified and reach `outbox-core` through its hidden
//! `__private` module, so the user needs no imports besides the derive.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt as _;
use syn::{Data, DeriveInput, Generics, Ident, parse_quote};

use crate::ast::{Event, Variant};

/// Expands the derive; on error, the errors plus a stub impl so the user sees the real
/// mistakes and not a cascade of "trait not implemented".
pub(crate) fn derive(input: &DeriveInput) -> TokenStream {
    match Event::from_input(input) {
        Ok(event) => expand(&event),
        Err(e) => {
            let mut out = e.into_compile_error();
            out.extend(fallback(input));
            out
        }
    }
}

/// The generics of the trait impl: the type's own, plus what the trait requires of `Self`
/// when the type is generic (so the impl states it rather than failing inside).
fn impl_generics(input: &DeriveInput) -> Generics {
    let mut generics = input.generics.clone();
    if !generics.params.is_empty() {
        generics.make_where_clause().predicates.push(parse_quote! {
            Self: ::outbox_core::__private::Serialize
                + ::outbox_core::__private::DeserializeOwned
                + ::core::marker::Send + 'static
        });
    }
    generics
}

fn expand(event: &Event<'_>) -> TokenStream {
    let input = event.input;
    let ident = &input.ident;
    let generics = impl_generics(input);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let event_types = event.variants.iter().map(|v| &v.name);
    let mut topics: Vec<&str> = Vec::new();
    for v in &event.variants {
        if !topics.contains(&v.topic.as_str()) {
            topics.push(&v.topic);
        }
    }
    let version = event.version;
    let topic_arms = event.variants.iter().map(|v| arm(v, &v.topic));
    let name_arms = event.variants.iter().map(|v| arm(v, &v.name));
    let key_arms = event.variants.iter().map(business_key_arm);
    let msg_id_arms = event.variants.iter().map(msg_id_arm);
    let ordering = ordering_key(event);
    let inherent = (!event.is_enum).then(|| inherent_items(event));
    quote! {
        #[automatically_derived]
        impl #impl_generics ::outbox_core::OutboxEvent for #ident #ty_generics #where_clause {
            const EVENT_TYPES: &'static [&'static str] = &[#(#event_types),*];
            const TOPICS: &'static [&'static str] = &[#(#topics),*];
            const SCHEMA_VERSION: u32 = #version;

            fn topic(&self) -> &'static str {
                match self { #(#topic_arms)* }
            }

            fn event_type(&self) -> &'static str {
                match self { #(#name_arms)* }
            }

            fn business_key(&self) -> ::outbox_core::__private::String {
                match self { #(#key_arms)* }
            }

            fn msg_id(&self) -> ::core::result::Result<::outbox_core::MsgId, ::outbox_core::InvalidMsgId> {
                match self { #(#msg_id_arms)* }
            }

            #ordering
        }

        #inherent
    }
}

/// `Self::Variant { .. } => "value",` (or `Self { .. }` for a struct).
fn arm(v: &Variant, value: &str) -> TokenStream {
    let pat = pattern(v, &[]);
    quote!(#pat => #value,)
}

fn pattern(v: &Variant, bind: &[&syn::Ident]) -> TokenStream {
    let path = match &v.ident {
        Some(variant) => quote!(Self::#variant),
        None => quote!(Self),
    };
    quote!(#path { #(#bind,)* .. })
}

fn unique(fields: &[syn::Ident]) -> Vec<&syn::Ident> {
    let mut out: Vec<&syn::Ident> = Vec::new();
    for f in fields {
        if !out.contains(&f) {
            out.push(f);
        }
    }
    out
}

fn business_key_arm(v: &Variant) -> TokenStream {
    let args = &v.id.args;
    let pat = pattern(v, &unique(args));
    let format = &v.id.format;
    let spanned_args = args
        .iter()
        .map(|a| quote_spanned!(a.span()=> &#a as &dyn ::core::fmt::Display));
    quote!(#pat => ::outbox_core::__private::format!(#format, #(#spanned_args),*),)
}

/// The id parts of `args`, each checked: an empty one returns
/// `InvalidMsgId::EmptyPart` naming its field, before the parts are joined (a key built
/// from empty parts, `:OrderPaid`, would make every such event one duplicate).
fn checked_parts(args: &[Ident]) -> impl Iterator<Item = TokenStream> + '_ {
    args.iter().map(|a| {
        let field = a.unraw().to_string();
        quote_spanned!(a.span()=>
            ::outbox_core::__private::id_part(#field, &#a as &dyn ::core::fmt::Display)?
        )
    })
}

fn msg_id_arm(v: &Variant) -> TokenStream {
    let pat = pattern(v, &unique(&v.id.args));
    let (format, name) = (&v.id.format, &v.name);
    let parts = checked_parts(&v.id.args);
    quote! {
        #pat => ::outbox_core::MsgId::from_parts(
            &::outbox_core::__private::format!(#format, #(#parts),*),
            #name,
        ),
    }
}

fn ordering_key(event: &Event<'_>) -> Option<TokenStream> {
    if event.variants.iter().all(|v| v.key.is_none()) {
        return None; // the trait's default: the business key
    }
    let arms = event.variants.iter().map(|v| match &v.key {
        Some(k) => {
            let pat = pattern(v, &[k]);
            quote_spanned!(k.span()=> #pat => ::outbox_core::__private::ToString::to_string(#k),)
        }
        None => {
            let pat = pattern(v, &[]);
            quote!(#pat => ::outbox_core::OutboxEvent::business_key(self),)
        }
    });
    Some(quote! {
        fn ordering_key(&self) -> ::outbox_core::__private::String {
            match self { #(#arms)* }
        }
    })
}

/// `TOPIC`, `EVENT_TYPE` and `msg_id_for` on a struct, usable without the trait in scope.
fn inherent_items(event: &Event<'_>) -> TokenStream {
    let input = event.input;
    let (ident, vis) = (&input.ident, &input.vis);
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let v = &event.variants[0];
    let (topic, name, format) = (&v.topic, &v.name, &v.id.format);
    let params = unique(&v.id.args);
    let parts = checked_parts(&v.id.args);
    let doc_fields = params
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let doc = format!(
        "The msg_id of the `{name}` event whose id field(s) {doc_fields} have these values, \
         without building the event. A value that renders empty is an \
         [`InvalidMsgId::EmptyPart`](::outbox_core::InvalidMsgId::EmptyPart) naming its field."
    );
    let generic_params: Vec<_> = (0..params.len())
        .map(|i| format_ident!("__OutboxId{}", i))
        .collect();
    quote! {
        #[automatically_derived]
        impl #impl_generics #ident #ty_generics #where_clause {
            /// The stream topic this event is published to.
            #vis const TOPIC: &'static str = #topic;
            /// The event type name carried with each message and used to route it.
            #vis const EVENT_TYPE: &'static str = #name;

            #[doc = #doc]
            #vis fn msg_id_for<#(#generic_params: ::core::fmt::Display),*>(#(#params: #generic_params),*)
                -> ::core::result::Result<::outbox_core::MsgId, ::outbox_core::InvalidMsgId>
            {
                ::outbox_core::MsgId::from_parts(&::outbox_core::__private::format!(#format, #(#parts),*), #name)
            }
        }
    }
}

/// A stub impl, so that code using the event reports the derive's errors only. Not for
/// unions and borrowing or const-generic types: an impl for them would fail on its own.
fn fallback(input: &DeriveInput) -> Option<TokenStream> {
    let unsupported = matches!(input.data, Data::Union(_))
        || input.generics.lifetimes().next().is_some()
        || input.generics.const_params().next().is_some();
    if unsupported {
        return None;
    }
    let (ident, vis) = (&input.ident, &input.vis);
    let generics = impl_generics(input);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    // `msg_id_for` cannot be stubbed: its parameters come from the attributes in error.
    let inherent = matches!(input.data, Data::Struct(_)).then(|| {
        let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
        quote! {
            #[automatically_derived]
            impl #impl_generics #ident #ty_generics #where_clause {
                /// Not generated: `#[derive(OutboxEvent)]` failed.
                #vis const TOPIC: &'static str = "";
                /// Not generated: `#[derive(OutboxEvent)]` failed.
                #vis const EVENT_TYPE: &'static str = "";
            }
        }
    });
    Some(quote! {
        #inherent

        #[automatically_derived]
        impl #impl_generics ::outbox_core::OutboxEvent for #ident #ty_generics #where_clause {
            const EVENT_TYPES: &'static [&'static str] = &[];
            const TOPICS: &'static [&'static str] = &[];
            const SCHEMA_VERSION: u32 = 0;
            fn topic(&self) -> &'static str { ::core::unreachable!() }
            fn event_type(&self) -> &'static str { ::core::unreachable!() }
            fn business_key(&self) -> ::outbox_core::__private::String { ::core::unreachable!() }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(src: &str) -> String {
        let input: DeriveInput = syn::parse_str(src).unwrap();
        derive(&input).to_string()
    }

    #[test]
    fn struct_with_one_id_field() {
        let out =
            expand_str("struct OrderPaid { #[outbox(id)] order_id: String, amount_cents: i64 }");
        assert!(
            out.contains("const EVENT_TYPES : & 'static [& 'static str] = & [\"OrderPaid\"]"),
            "{out}"
        );
        assert!(
            out.contains("const TOPICS : & 'static [& 'static str] = & [\"order.paid\"]"),
            "{out}"
        );
        assert!(
            out.contains("const TOPIC : & 'static str = \"order.paid\""),
            "{out}"
        );
        assert!(out.contains("fn msg_id_for"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
        // Each id part is checked, by its field's name, in `msg_id` and `msg_id_for`.
        assert_eq!(
            out.matches("id_part (\"order_id\" , & order_id").count(),
            2,
            "{out}"
        );
    }

    #[test]
    fn several_id_fields_join_with_colon() {
        let out = expand_str(
            "struct A { #[outbox(id)] tenant: String, x: u8, #[outbox(id)] order: u64 }",
        );
        assert!(out.contains("format ! (\"{}:{}\""), "{out}");
    }

    #[test]
    fn template_becomes_format_string() {
        let out = expand_str(
            r#"#[outbox(id = "{tenant}/{order_id}", topic = "orders", name = "Paid", version = 3)] struct A { tenant: String, order_id: u64 }"#,
        );
        assert!(out.contains("format ! (\"{}/{}\""), "{out}");
        assert!(out.contains("& [\"orders\"]"), "{out}");
        assert!(out.contains("& [\"Paid\"]"), "{out}");
        assert!(out.contains("SCHEMA_VERSION : u32 = 3u32"), "{out}");
    }

    #[test]
    fn enum_variants_are_event_types() {
        let out = expand_str(
            r#"#[outbox(id = "{order_id}")] enum OrderEvent { Paid { order_id: String }, #[outbox(topic = "refunds")] Refunded { order_id: String } }"#,
        );
        assert!(out.contains("& [\"Paid\" , \"Refunded\"]"), "{out}");
        assert!(out.contains("& [\"order.event\" , \"refunds\"]"), "{out}");
        assert!(
            !out.contains("msg_id_for"),
            "enums have no single-type builder: {out}"
        );
    }

    #[test]
    fn key_field_overrides_ordering_key() {
        let out = expand_str(
            "#[outbox(key = account)] struct A { #[outbox(id)] id: String, account: String }",
        );
        assert!(out.contains("fn ordering_key"), "{out}");
    }

    #[test]
    fn errors_are_collected_and_stub_emitted() {
        let out = expand_str(r#"#[outbox(topic = "", colour = "red")] struct A { x: String }"#);
        assert_eq!(out.matches("compile_error").count(), 3, "{out}");
        assert!(out.contains("unreachable"), "stub impl expected: {out}");
    }

    #[test]
    fn a_bad_item_does_not_hide_the_next() {
        let out = expand_str(
            r#"#[outbox(colour = "red", topic = "", version = x)] struct A { #[outbox(id = "x", skip(y))] a: String }"#,
        );
        for msg in [
            "unknown outbox attribute `colour`",
            "#[outbox(topic)] is empty",
            "#[outbox(version)] must be an integer",
            "#[outbox(id)] on a field takes no value",
            "unknown outbox field attribute `skip`",
        ] {
            assert!(out.contains(msg), "missing {msg:?}: {out}");
        }
        assert_eq!(out.matches("compile_error").count(), 5, "{out}");
    }

    #[test]
    fn generic_bounds_extend_an_existing_where_clause() {
        let out = expand_str("struct A<T> where T: Clone, { #[outbox(id)] id: String, t: T }");
        assert!(!out.contains(", ,"), "{out}");
        assert!(
            out.contains("where T : Clone , Self : :: outbox_core :: __private :: Serialize"),
            "{out}"
        );
    }

    #[test]
    fn no_stub_impl_where_it_would_fail_on_its_own() {
        for src in [
            "union U { #[outbox(id)] a: u64 }",
            "struct A<'a> { #[outbox(id)] id: &'a str }",
            "struct A<const N: usize> { #[outbox(id)] id: String }",
        ] {
            let out = expand_str(src);
            assert_eq!(out.matches("compile_error").count(), 1, "{out}");
            assert!(!out.contains("impl"), "{src}: {out}");
        }
    }

    #[test]
    fn variant_field_ids_replace_the_enum_template() {
        let out = expand_str(
            r#"#[outbox(id = "{a}")] enum E { X { a: String }, Y { a: String, #[outbox(id)] b: u8 } }"#,
        );
        assert!(!out.contains("compile_error"), "{out}");
        assert!(out.contains("Self :: Y { b , .. }"), "{out}");
    }
}
