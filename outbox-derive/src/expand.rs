//! Code generation from a validated [`Event`]. Paths are fully qualified and reach
//! `outbox-core` through its hidden `__private` module (by `::outbox_core`, or the path of
//! `#[outbox(crate = "...")]`), so the user needs no imports besides the derive.
//!
//! Every impl is `#[automatically_derived]` and allows `unused_qualifications`: a path from
//! `#[outbox(crate = "...")]` carries the user's span, so rustc lints it as the user's
//! code, and `my_app::outbox::__private::String` names the prelude's `String` in full.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens as _, format_ident, quote, quote_spanned};
use syn::ext::IdentExt as _;
use syn::{Data, DeriveInput, Generics, Ident, parse_quote};

use crate::ast::{Event, Shape, Variant};
use crate::ctxt::Ctxt;
use crate::valid;

/// Expands the derive; on error, the errors plus a stub impl so the user sees the real
/// mistakes and not a cascade of "trait not implemented".
pub(crate) fn derive(input: &DeriveInput) -> TokenStream {
    derive_in(input, "outbox_core")
}

/// [`derive`], reaching `outbox-core` by `::<default_krate>` unless `#[outbox(crate)]`
/// says otherwise.
pub(crate) fn derive_in(input: &DeriveInput, default_krate: &'static str) -> TokenStream {
    let cx = Ctxt::default();
    let mut event = Event::from_input(&cx, input);
    event.default_krate = default_krate;
    valid::check(&cx, &event);
    match cx.finish() {
        Ok(()) => expand(&event),
        Err(e) => {
            let mut out = e.into_compile_error();
            out.extend(fallback(&event));
            out
        }
    }
}

/// The generics of the trait impl: the type's own, plus what the trait requires of `Self`
/// when the type is generic (so the impl states it rather than failing inside).
fn impl_generics(input: &DeriveInput, krate: &TokenStream) -> Generics {
    let mut generics = input.generics.clone();
    if !generics.params.is_empty() {
        generics.make_where_clause().predicates.push(parse_quote! {
            Self: #krate::__private::Serialize
                + #krate::__private::DeserializeOwned
                + ::core::marker::Send + 'static
        });
    }
    generics
}

fn expand(event: &Event<'_>) -> TokenStream {
    let input = event.input;
    let (ident, krate) = (&input.ident, &krate(event));
    let generics = impl_generics(input, krate);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let event_types = event.variants.iter().map(|v| &v.name.value);
    let mut topics: Vec<&str> = Vec::new();
    for v in &event.variants {
        if !topics.contains(&v.topic.value.as_str()) {
            topics.push(&v.topic.value);
        }
    }
    let version = event.version;
    let partitions = event
        .partitions
        .map(|n| quote!(const PARTITIONS: u32 = #n;));
    let topic_arms = event.variants.iter().map(|v| arm(v, &v.topic.value));
    let name_arms = event.variants.iter().map(|v| arm(v, &v.name.value));
    let key_arms = event.variants.iter().map(|v| business_key_arm(event, v));
    let msg_id_arms = event.variants.iter().map(|v| msg_id_arm(event, v));
    let ordering = ordering_key(event);
    let inherent = matches!(event.shape, Shape::Struct).then(|| inherent_items(event));
    let msg_id = quote!(::core::result::Result<#krate::MsgId, #krate::InvalidMsgId>);
    quote! {
        #[automatically_derived]
        #[allow(unused_qualifications)]
        impl #impl_generics #krate::OutboxEvent for #ident #ty_generics #where_clause {
            const EVENT_TYPES: &'static [&'static str] = &[#(#event_types),*];
            const TOPICS: &'static [&'static str] = &[#(#topics),*];
            const SCHEMA_VERSION: u32 = #version;
            #partitions

            fn topic(&self) -> &'static str {
                match self { #(#topic_arms)* }
            }

            fn event_type(&self) -> &'static str {
                match self { #(#name_arms)* }
            }

            fn business_key(&self) -> #krate::__private::String {
                match self { #(#key_arms)* }
            }

            fn msg_id(&self) -> #msg_id {
                match self { #(#msg_id_arms)* }
            }

            #ordering
        }

        #inherent
    }
}

/// `Self::Variant { .. } => "value",` (or `Self { .. }` for a struct).
fn arm(v: &Variant<'_>, value: &str) -> TokenStream {
    let pat = pattern(v, &[]);
    quote!(#pat => #value,)
}

fn pattern(v: &Variant<'_>, bind: &[&Ident]) -> TokenStream {
    let path = match &v.ident {
        Some(variant) => quote!(Self::#variant),
        None => quote!(Self),
    };
    quote!(#path { #(#bind,)* .. })
}

fn unique(fields: &[Ident]) -> Vec<&Ident> {
    let mut out: Vec<&Ident> = Vec::new();
    for f in fields {
        if !out.contains(&f) {
            out.push(f);
        }
    }
    out
}

fn business_key_arm(event: &Event<'_>, v: &Variant<'_>) -> TokenStream {
    let krate = krate(event);
    let id = v.id();
    let pat = pattern(v, &unique(&id.args));
    let format = &id.format;
    let spanned_args = id
        .args
        .iter()
        .map(|a| quote_spanned!(a.span()=> &#a as &dyn ::core::fmt::Display));
    quote!(#pat => #krate::__private::format!(#format, #(#spanned_args),*),)
}

/// The id parts of `args`, each checked: an empty one returns
/// `InvalidMsgId::EmptyPart` naming its field, before the parts are joined (a key built
/// from empty parts, `:OrderPaid`, would make every such event one duplicate).
fn checked_parts<'a>(event: &'a Event<'_>, args: &'a [Ident]) -> impl Iterator<Item = TokenStream> {
    args.iter().map(move |a| {
        let field = a.unraw().to_string();
        let id_part = private_at(event, a.span(), &["id_part"]);
        quote_spanned!(a.span()=> #id_part(#field, &#a as &dyn ::core::fmt::Display)?)
    })
}

/// The path generated code reaches `outbox-core` by. A path from `crate = "..."` keeps the
/// span of its string, so a path that resolves to nothing is reported there.
fn krate(event: &Event<'_>) -> TokenStream {
    match &event.krate {
        Some(path) => path.to_token_stream(),
        None => {
            let krate = Ident::new(event.default_krate, Span::call_site());
            quote!(::#krate)
        }
    }
}

/// `krate::__private::<segments>`, for code reported at a field's `span`. The default path
/// is spanned at the field as a whole. A `crate = "..."` path keeps its string's span and
/// the rest is the macro's: one path spanning both the string and the field would make
/// rustc suggest edits across the attribute.
fn private_at(event: &Event<'_>, span: Span, segments: &[&str]) -> TokenStream {
    match &event.krate {
        None => {
            let krate = Ident::new(event.default_krate, span);
            let segments = segments.iter().map(|s| Ident::new(s, span));
            quote_spanned!(span=> ::#krate::__private #(::#segments)*)
        }
        Some(path) => {
            let segments = segments.iter().map(|s| format_ident!("{s}"));
            quote!(#path::__private #(::#segments)*)
        }
    }
}

fn msg_id_arm(event: &Event<'_>, v: &Variant<'_>) -> TokenStream {
    let krate = krate(event);
    let id = v.id();
    let pat = pattern(v, &unique(&id.args));
    let (format, name) = (&id.format, &v.name.value);
    let parts = checked_parts(event, &id.args);
    quote! {
        #pat => #krate::MsgId::from_parts(
            &#krate::__private::format!(#format, #(#parts),*),
            #name,
        ),
    }
}

fn ordering_key(event: &Event<'_>) -> Option<TokenStream> {
    if event.variants.iter().all(|v| v.key.is_none()) {
        return None; // the trait's default: the business key
    }
    let krate = krate(event);
    let arms = event.variants.iter().map(|v| match &v.key {
        Some(k) => {
            let pat = pattern(v, &[k]);
            let to_string = private_at(event, k.span(), &["ToString", "to_string"]);
            quote_spanned!(k.span()=> #pat => #to_string(#k),)
        }
        None => {
            let pat = pattern(v, &[]);
            quote!(#pat => #krate::OutboxEvent::business_key(self),)
        }
    });
    Some(quote! {
        fn ordering_key(&self) -> #krate::__private::String {
            match self { #(#arms)* }
        }
    })
}

/// `TOPIC`, `EVENT_TYPE` and `msg_id_for` on a struct, usable without the trait in scope.
fn inherent_items(event: &Event<'_>) -> TokenStream {
    let input = event.input;
    let (ident, vis, krate) = (&input.ident, &input.vis, krate(event));
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let Some(v) = event.variants.first() else {
        return TokenStream::new(); // a struct is one variant
    };
    let id = v.id();
    let (topic, name, format) = (&v.topic.value, &v.name.value, &id.format);
    let params = unique(&id.args);
    let parts = checked_parts(event, &id.args);
    let doc = msg_id_for_doc(name, &params, &krate);
    let generic_params: Vec<_> = (0..params.len())
        .map(|i| format_ident!("__OutboxId{}", i))
        .collect();
    let msg_id = quote!(::core::result::Result<#krate::MsgId, #krate::InvalidMsgId>);
    quote! {
        #[automatically_derived]
        #[allow(unused_qualifications)]
        impl #impl_generics #ident #ty_generics #where_clause {
            /// The stream topic this event is published to.
            #vis const TOPIC: &'static str = #topic;
            /// The event type name carried with each message and used to route it.
            #vis const EVENT_TYPE: &'static str = #name;

            #[doc = #doc]
            #vis fn msg_id_for<#(#generic_params: ::core::fmt::Display),*>(
                #(#params: #generic_params),*
            ) -> #msg_id {
                #krate::MsgId::from_parts(
                    &#krate::__private::format!(#format, #(#parts),*),
                    #name
                )
            }
        }
    }
}

fn msg_id_for_doc(name: &str, params: &[&Ident], krate: &TokenStream) -> String {
    let fields = params
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let krate = krate.to_string().replace(' ', "");
    format!(
        "The msg_id of the `{name}` event whose id field(s) {fields} have these values, \
         without building the event. A value that renders empty is an \
         [`InvalidMsgId::EmptyPart`]({krate}::InvalidMsgId::EmptyPart) naming its field."
    )
}

/// A stub impl, so that code using the event reports the derive's errors only. Not for
/// unions and borrowing or const-generic types: an impl for them would fail on its own.
fn fallback(event: &Event<'_>) -> Option<TokenStream> {
    let input = event.input;
    let unsupported = matches!(input.data, Data::Union(_))
        || input.generics.lifetimes().next().is_some()
        || input.generics.const_params().next().is_some();
    if unsupported {
        return None;
    }
    let (ident, vis, krate) = (&input.ident, &input.vis, &krate(event));
    let generics = impl_generics(input, krate);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    // `msg_id_for` cannot be stubbed: its parameters come from the attributes in error.
    let inherent = matches!(input.data, Data::Struct(_)).then(|| {
        let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
        quote! {
            #[automatically_derived]
            #[allow(unused_qualifications)]
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
        #[allow(unused_qualifications)]
        impl #impl_generics #krate::OutboxEvent for #ident #ty_generics #where_clause {
            const EVENT_TYPES: &'static [&'static str] = &[];
            const TOPICS: &'static [&'static str] = &[];
            const SCHEMA_VERSION: u32 = 0;
            fn topic(&self) -> &'static str { ::core::unreachable!() }
            fn event_type(&self) -> &'static str { ::core::unreachable!() }
            fn business_key(&self) -> #krate::__private::String { ::core::unreachable!() }
        }
    })
}

/// Expansion snapshots in `src/snapshots/`. After a deliberate change, regenerate them with
/// `INSTA_UPDATE=always cargo test -p typed-outbox-derive` (or `cargo insta review`) and review
/// every changed `.snap` as code.
#[cfg(test)]
mod tests {
    use proc_macro2::TokenStream;
    use quote::quote;
    use syn::DeriveInput;

    /// The expansion of `#[derive(OutboxEvent)]` on `input`, pretty-printed. Parsing it
    /// as a file also checks that the expansion is well-formed items.
    fn expand(input: TokenStream) -> String {
        let input: DeriveInput = syn::parse2(input).expect("a derive input");
        let file: syn::File = syn::parse2(super::derive(&input)).expect("items");
        prettyplease::unparse(&file)
    }

    /// The expansion of an input the derive accepts: no `compile_error!` in it.
    fn expand_ok(input: TokenStream) -> String {
        let out = expand(input);
        assert!(!out.contains("compile_error!"), "{out}");
        out
    }

    /// Each id part is checked, by its field's name, in `msg_id` and `msg_id_for`.
    #[test]
    fn struct_with_one_id_field() {
        insta::assert_snapshot!(expand_ok(quote! {
            struct OrderPaid {
                #[outbox(id)]
                order_id: String,
                amount_cents: i64,
            }
        }));
    }

    #[test]
    fn several_id_fields_join_with_colon() {
        insta::assert_snapshot!(expand_ok(quote! {
            struct A {
                #[outbox(id)]
                tenant: String,
                x: u8,
                #[outbox(id)]
                order: u64,
            }
        }));
    }

    #[test]
    fn template_becomes_format_string() {
        insta::assert_snapshot!(expand_ok(quote! {
            #[outbox(id = "{tenant}/{order_id}", topic = "orders", name = "Paid", version = 3)]
            struct A {
                tenant: String,
                order_id: u64,
            }
        }));
    }

    /// Enums have no single-type builder (`msg_id_for`, `TOPIC`).
    #[test]
    fn enum_variants_are_event_types() {
        insta::assert_snapshot!(expand_ok(quote! {
            #[outbox(id = "{order_id}")]
            enum OrderEvent {
                Paid { order_id: String },
                #[outbox(topic = "refunds")]
                Refunded { order_id: String },
            }
        }));
    }

    /// Only a type that sets it gets `PARTITIONS`; the others keep the trait's default.
    #[test]
    fn partitions_set_the_const() {
        insta::assert_snapshot!(expand_ok(quote! {
            #[outbox(id = "{order_id}", partitions = 8)]
            enum OrderEvent {
                Paid { order_id: String },
                #[outbox(topic = "refunds")]
                Refunded { order_id: String },
            }
        }));
    }

    #[test]
    fn key_field_overrides_ordering_key() {
        insta::assert_snapshot!(expand_ok(quote! {
            #[outbox(key = account)]
            struct A {
                #[outbox(id)]
                id: String,
                account: String,
            }
        }));
    }

    /// Three errors, then the stub impls that keep code using the type from cascading.
    #[test]
    fn errors_are_collected_and_stub_emitted() {
        insta::assert_snapshot!(expand(quote! {
            #[outbox(topic = "", colour = "red")]
            struct A {
                x: String,
            }
        }));
    }

    #[test]
    fn a_bad_item_does_not_hide_the_next() {
        insta::assert_snapshot!(expand(quote! {
            #[outbox(colour = "red", topic = "", version = x)]
            struct A {
                #[outbox(id = "x", skip(y))]
                a: String,
            }
        }));
    }

    #[test]
    fn generic_bounds_extend_an_existing_where_clause() {
        insta::assert_snapshot!(expand_ok(quote! {
            struct A<T>
            where
                T: Clone,
            {
                #[outbox(id)]
                id: String,
                t: T,
            }
        }));
    }

    /// Only the error: an impl for these types would fail on its own.
    #[test]
    fn no_stub_impl_where_it_would_fail_on_its_own() {
        let cases = [
            ("union", quote!(union U { #[outbox(id)] a: u64 })),
            (
                "lifetime",
                quote!(
                    struct A<'a> {
                        #[outbox(id)]
                        id: &'a str,
                    }
                ),
            ),
            (
                "const",
                quote!(
                    struct A<const N: usize> {
                        #[outbox(id)]
                        id: String,
                    }
                ),
            ),
        ];
        for (name, input) in cases {
            insta::assert_snapshot!(format!("no_stub_impl_{name}"), expand(input));
        }
    }

    #[test]
    fn variant_field_ids_replace_the_enum_template() {
        insta::assert_snapshot!(expand_ok(quote! {
            #[outbox(id = "{a}")]
            enum E {
                X { a: String },
                Y { a: String, #[outbox(id)] b: u8 },
            }
        }));
    }

    /// Every path to `outbox-core` is the one given, also in the `msg_id_for` doc link.
    #[test]
    fn crate_attribute_replaces_every_path() {
        let out = expand_ok(quote! {
            #[outbox(crate = "my_app::outbox", key = account)]
            struct A<T> {
                #[outbox(id)]
                id: String,
                account: String,
                t: T,
            }
        });
        assert!(!out.contains("outbox_core"), "{out}");
        insta::assert_snapshot!(out);
    }

    /// The stub impl after an error uses the given path too: no second error for a crate
    /// that is not named `outbox_core`.
    #[test]
    fn crate_attribute_reaches_the_stub() {
        let out = expand(quote! {
            #[outbox(crate = "my_app::outbox", topic = "")]
            struct A {
                #[outbox(id)]
                id: String,
            }
        });
        assert!(!out.contains("outbox_core"), "{out}");
        insta::assert_snapshot!(out);
    }

    /// The facade's derive reaches `::outbox` everywhere, the stub after an error included,
    /// and `crate = "..."` still wins over it.
    #[test]
    fn facade_derive_reaches_the_facade() {
        let facade = |input: TokenStream| {
            let input: DeriveInput = syn::parse2(input).expect("a derive input");
            super::derive_in(&input, "outbox").to_string()
        };
        for input in [
            quote! { struct A { #[outbox(id)] id: String } },
            quote! { #[outbox(topic = "")] struct A { #[outbox(id)] id: String } },
        ] {
            let out = facade(input);
            assert!(out.contains(":: outbox :: __private"), "{out}");
            assert!(!out.contains("outbox_core"), "{out}");
        }
        let out = facade(
            quote! { #[outbox(crate = "my_app::outbox")] struct A { #[outbox(id)] id: String } },
        );
        assert!(out.contains("my_app :: outbox :: __private"), "{out}");
    }
}
