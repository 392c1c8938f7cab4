//! Checking that errors never show a password: the tests of wrong credentials give a
//! recognisable secret and look for it in everything an error can print.

/// Panics if `secret` appears in `e`'s `Display` or `Debug`, or in those of any error
/// in its `source()` chain.
pub fn assert_hidden(e: &dyn std::error::Error, secret: &str) {
    let mut text = format!("{e}\n{e:?}");
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!("\n{s}\n{s:?}"));
        source = s.source();
    }
    assert!(!text.contains(secret), "the password leaked: {text}");
}
