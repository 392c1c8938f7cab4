//! Code generation. Paths are fully qualified and reach `outbox-core` through its hidden
//! `__private` module, so the user needs no imports besides the derive.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::DeriveInput;

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

fn expand(event: &Event<'_>) -> TokenStream {
    let input = event.input;
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let bounds = event_bounds(input);
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
    let ordering = ordering_key(event);
    let inherent = (!event.is_enum).then(|| inherent_items(event));
    quote! {
        #[automatically_derived]
        impl #impl_generics ::outbox_core::OutboxEvent for #ident #ty_generics #where_clause #bounds {
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

fn unique<'a>(fields: &'a [syn::Ident]) -> Vec<&'a syn::Ident> {
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
    let args = &v.id.args;
    let doc_fields = params
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let doc = format!(
        "The msg_id of the `{name}` event whose id field(s) {doc_fields} have these values, \
         without building the event."
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
                ::outbox_core::MsgId::from_parts(&::outbox_core::__private::format!(#format, #(#args),*), #name)
            }
        }
    }
}

/// Generic events get `Self: Serialize + DeserializeOwned + Send + 'static` so the impl
/// states what the trait needs rather than failing inside it.
fn event_bounds(input: &DeriveInput) -> Option<TokenStream> {
    if input.generics.params.is_empty() {
        return None;
    }
    let lead = if input.generics.where_clause.is_some() {
        quote!(,)
    } else {
        quote!(where)
    };
    Some(quote! {
        #lead Self: ::outbox_core::__private::Serialize
            + ::outbox_core::__private::DeserializeOwned
            + ::core::marker::Send + 'static
    })
}

fn fallback(input: &DeriveInput) -> TokenStream {
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    quote! {
        #[automatically_derived]
        impl #impl_generics ::outbox_core::OutboxEvent for #ident #ty_generics #where_clause {
            const EVENT_TYPES: &'static [&'static str] = &[];
            const TOPICS: &'static [&'static str] = &[];
            const SCHEMA_VERSION: u32 = 0;
            fn topic(&self) -> &'static str { ::core::unreachable!() }
            fn event_type(&self) -> &'static str { ::core::unreachable!() }
            fn business_key(&self) -> ::outbox_core::__private::String { ::core::unreachable!() }
        }
    }
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
}
