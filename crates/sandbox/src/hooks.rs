//! Test-only fault injection: `KUMO_TEST_HOOK=name[,name...]` turns named hooks on, in debug
//! builds only. A release build compiles every hook to `false`, so nothing in a production
//! binary can be triggered from its environment.

/// Whether the test hook `name` is on (`KUMO_TEST_HOOK` lists it; debug builds only).
#[cfg(debug_assertions)]
pub fn test_hook(name: &str) -> bool {
    std::env::var("KUMO_TEST_HOOK").is_ok_and(|v| v.split(',').any(|h| h.trim() == name))
}

/// Whether the test hook `name` is on: never, in a release build.
#[cfg(not(debug_assertions))]
pub fn test_hook(_name: &str) -> bool {
    false
}

#[cfg(all(test, debug_assertions))]
mod tests {
    #[test]
    fn hooks_are_read_from_the_comma_separated_list() {
        // The variable is process-wide; this test is the only one that touches it.
        std::env::set_var("KUMO_TEST_HOOK", "a, seccomp-violation:vcpu");
        assert!(super::test_hook("seccomp-violation:vcpu"));
        assert!(super::test_hook("a"));
        assert!(!super::test_hook("seccomp-violation"));
        std::env::remove_var("KUMO_TEST_HOOK");
        assert!(!super::test_hook("a"));
    }
}
