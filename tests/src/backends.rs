//! [`on_every_backend!`](crate::on_every_backend): one `#[test]` per backend for each
//! scenario, in a module named after the backend, so a failure reads
//! `postgres::scenario` or `sqlite::scenario`.

/// Generates, for each `module => Backend` pair, a module `module` holding one
/// `#[test] fn scenario() { super::scenario::<Backend>() }` per listed scenario.
///
/// Each scenario is a generic function of the calling test file, `fn scenario<B>()`;
/// `Backend` is any type in scope there (the crate's fixture types, e.g. `Pg`). List
/// only the backends a scenario applies to.
///
/// ```ignore
/// outbox_tests::on_every_backend! {
///     postgres => Pg, mariadb => My, sqlite => Lite;
///     commit_writes_the_message,
///     rollback_writes_nothing,
/// }
/// ```
#[macro_export]
macro_rules! on_every_backend {
    (@each [$($module:ident => $backend:ty),+] $scenarios:tt) => {
        $( $crate::on_every_backend!(@module $module, $backend, $scenarios); )+
    };
    (@module $module:ident, $backend:ty, [$($scenario:ident),+]) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $scenario() {
                    super::$scenario::<$backend>();
                }
            )+
        }
    };
    ($($module:ident => $backend:ty),+ ; $($scenario:ident),+ $(,)?) => {
        $crate::on_every_backend!(@each [$($module => $backend),+] [$($scenario),+]);
    };
}
