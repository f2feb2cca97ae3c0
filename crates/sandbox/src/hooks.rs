//! Test-only fault hooks: a debug build reads `KUMO_TEST_HOOK` (comma-separated names) and the
//! code at each named point misbehaves on purpose (a thread panics, ...), so end-to-end tests
//! can show that kumo contains it. Release builds compile every hook to `false`.
//!
//! Hooks: `panic:vcpu` (vCPU 0 panics after the guest has run a while), `panic:migration`
//! (the first outgoing migration's job panics after its first round: dirty logging is on),
//! `panic:device` (the device event loop panics on its first event), `panic:api` (the API
//! handler panics on `vm.counters`). The variable is read once, when a hook is first asked.

/// Whether hook `name` is on (always false in a release build).
pub fn test_hook(name: &str) -> bool {
    #[cfg(debug_assertions)]
    {
        // Read once: hooks are asked on hot paths (every event of an event loop).
        static HOOKS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        hook_named(HOOKS.get_or_init(|| std::env::var("KUMO_TEST_HOOK").unwrap_or_default()), name)
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = name;
        false
    }
}

/// [`test_hook`], true only the first time it is asked for `name` in this process: a one-shot
/// fault (the first migration panics, the next one runs as usual).
pub fn test_hook_once(name: &str) -> bool {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static FIRED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    if !test_hook(name) {
        return false;
    }
    let mut fired = FIRED.lock().unwrap_or_else(|p| p.into_inner());
    fired.get_or_insert_with(HashSet::new).insert(name.to_string())
}

/// Whether the comma-separated list `list` names `name`.
#[cfg_attr(not(debug_assertions), allow(dead_code))]
fn hook_named(list: &str, name: &str) -> bool {
    list.split(',').map(str::trim).any(|h| h == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_name_hooks_exactly() {
        assert!(hook_named("panic:vcpu", "panic:vcpu"));
        assert!(hook_named("panic:device, panic:vcpu", "panic:vcpu"));
        assert!(!hook_named("panic:vcpus", "panic:vcpu"));
        assert!(!hook_named("", "panic:vcpu"));
    }

    #[test]
    fn an_unset_hook_is_off() {
        // No test sets KUMO_TEST_HOOK: setting the environment races other tests' threads.
        assert!(!test_hook("panic:no-such-hook"));
        assert!(!test_hook_once("panic:no-such-hook"));
    }
}
