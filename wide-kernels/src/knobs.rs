//! The `WIDE_*` environment knobs: A/B switches, sweep settings and measurement modes of the
//! kernels, the inference engine and the trainer (the README's "Environment variables" lists
//! them). One parse for all of them: surrounding spaces are ignored, unset or empty means the
//! knob's default, and a value the knob does not take is named in one warning line on stderr
//! (once a process) and the default is kept, so a mistyped setting never passes silently for
//! the default in a benchmark sweep. Knobs whose misuse would change what a run means (such as
//! `WIDE_TUNE`, `WIDE_LAYOUT`, `WIDE_ROUTER_FOLD` or `WIDE_STEP_READS`) are errors instead, where
//! they are read.
use std::collections::HashSet;
use std::ops::RangeInclusive;
use std::sync::{Mutex, OnceLock};

/// The trimmed value of `name`; None when unset, empty or not Unicode.
pub fn value(name: &str) -> Option<String> {
    trimmed(std::env::var(name).ok().as_deref()).map(str::to_owned)
}

fn trimmed(v: Option<&str>) -> Option<&str> {
    v.map(str::trim).filter(|v| !v.is_empty())
}

/// A parse's result: the value (None: the default), or what the knob takes and was given.
pub type Parsed<T> = Result<Option<T>, String>;

/// The value of a parse, or None after one warning line that names the knob and the value (once
/// a process per knob, since some knobs are read at every call).
pub fn report<T>(p: Parsed<T>) -> Option<T> {
    match p {
        Ok(v) => v,
        Err(msg) => {
            static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
            let first = WARNED.get_or_init(Default::default).lock().map(|mut w| w.insert(msg.clone())).unwrap_or(true);
            if first {
                eprintln!("warning: {msg}; ignored, the default is kept");
            }
            None
        }
    }
}

/// `0` (off) or `1` (on).
pub fn switch(name: &str) -> Option<bool> {
    report(switch_from(name, std::env::var(name).ok().as_deref()))
}

/// [`switch`]'s parse of a value `v` of `name`.
pub fn switch_from(name: &str, v: Option<&str>) -> Parsed<bool> {
    match trimmed(v) {
        None => Ok(None),
        Some("0") => Ok(Some(false)),
        Some("1") => Ok(Some(true)),
        Some(o) => Err(format!("{name} takes 0 or 1, got '{o}'")),
    }
}

/// An integer in `range`; `what` says what it counts (for the warning).
pub fn int(name: &str, range: RangeInclusive<i64>, what: &str) -> Option<i64> {
    report(int_from(name, std::env::var(name).ok().as_deref(), range, what))
}

/// [`int`]'s parse of a value `v` of `name`.
pub fn int_from(name: &str, v: Option<&str>, range: RangeInclusive<i64>, what: &str) -> Parsed<i64> {
    let Some(v) = trimmed(v) else { return Ok(None) };
    match v.parse::<i64>() {
        Ok(n) if range.contains(&n) => Ok(Some(n)),
        _ => {
            let bounds = if *range.end() == i64::MAX { format!("of at least {}", range.start()) } else { format!("in {}..={}", range.start(), range.end()) };
            Err(format!("{name} takes an integer {bounds} ({what}), got '{v}'"))
        }
    }
}

/// One of `choices`, exactly (after trimming).
pub fn choice(name: &str, choices: &[&'static str]) -> Option<&'static str> {
    report(choice_from(name, std::env::var(name).ok().as_deref(), choices))
}

/// [`choice`]'s parse of a value `v` of `name`.
pub fn choice_from(name: &str, v: Option<&str>, choices: &[&'static str]) -> Parsed<&'static str> {
    let Some(v) = trimmed(v) else { return Ok(None) };
    match choices.iter().find(|c| **c == v) {
        Some(c) => Ok(Some(*c)),
        None => Err(format!("{name} takes {}, got '{v}'", one_of(choices))),
    }
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(choices: &[&str]) -> String {
    match choices {
        [] => String::new(),
        [a] => a.to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_0_and_1_and_name_anything_else() {
        assert_eq!(switch_from("WIDE_X", None), Ok(None));
        assert_eq!(switch_from("WIDE_X", Some("  ")), Ok(None));
        assert_eq!(switch_from("WIDE_X", Some(" 0 ")), Ok(Some(false)));
        assert_eq!(switch_from("WIDE_X", Some("1")), Ok(Some(true)));
        let e = switch_from("WIDE_X", Some("yes")).unwrap_err();
        assert_eq!(e, "WIDE_X takes 0 or 1, got 'yes'");
        assert_eq!(report(switch_from("WIDE_X", Some("on"))), None);
        assert_eq!(report(switch_from("WIDE_X", Some("1"))), Some(true));
    }

    #[test]
    fn integers_keep_to_their_range() {
        assert_eq!(int_from("WIDE_N", Some(" 8 "), 1..=8, "blocks"), Ok(Some(8)));
        assert_eq!(int_from("WIDE_N", None, 1..=8, "blocks"), Ok(None));
        assert_eq!(int_from("WIDE_N", Some("9"), 1..=8, "blocks").unwrap_err(), "WIDE_N takes an integer in 1..=8 (blocks), got '9'");
        assert!(int_from("WIDE_N", Some("x"), 1..=8, "blocks").is_err());
        assert!(int_from("WIDE_N", Some("2.5"), 1..=8, "blocks").is_err());
        assert_eq!(int_from("WIDE_N", Some("0"), 0..=i64::MAX, "tokens"), Ok(Some(0)));
        assert_eq!(int_from("WIDE_N", Some("-1"), 0..=i64::MAX, "tokens").unwrap_err(), "WIDE_N takes an integer of at least 0 (tokens), got '-1'");
    }

    #[test]
    fn choices_are_exact_and_listed() {
        let c = ["routed", "dense"];
        assert_eq!(choice_from("WIDE_C", Some(" dense"), &c), Ok(Some("dense")));
        assert_eq!(choice_from("WIDE_C", Some(""), &c), Ok(None));
        assert_eq!(choice_from("WIDE_C", Some("Dense"), &c).unwrap_err(), "WIDE_C takes routed or dense, got 'Dense'");
        assert_eq!(choice_from("WIDE_C", Some("x"), &["a", "b", "c"]).unwrap_err(), "WIDE_C takes a, b or c, got 'x'");
        assert_eq!(choice_from("WIDE_C", Some("x"), &["ref"]).unwrap_err(), "WIDE_C takes ref, got 'x'");
    }
}
