//! Compile-fail tests for `#[derive(OutboxEvent)]`: each `tests/ui/<case>.rs` must fail to
//! build with exactly the diagnostics in `<case>.stderr`.
//!
//! Regenerate the expected output with `TRYBUILD=overwrite cargo test -p typed-outbox-core --test ui`
//! and review every changed `.stderr`: the message, its help line and the span it points at.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
