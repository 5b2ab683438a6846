//! Board profiles: data embedded from `boards/*.toml` at build time.
//!
//! Parsing and auto-detection of the profiles come with the board-runtime issue; the core only
//! exposes the embedded table so that every build, including bare metal, carries it.

use crate::build_config::BOARD_PROFILES;

/// The embedded profile file named `name` (file stem, e.g. `"generic-rk3588"`), if there is one.
pub fn profile_text(name: &str) -> Option<&'static str> {
    BOARD_PROFILES.iter().find(|(stem, _)| *stem == name).map(|(_, text)| *text)
}

/// Names of all embedded profiles, sorted.
pub fn profile_names() -> impl Iterator<Item = &'static str> {
    BOARD_PROFILES.iter().map(|(stem, _)| *stem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generic_profiles_are_embedded_and_sorted() {
        let text = profile_text("generic-rk3588").expect("boards/generic-rk3588.toml is embedded");
        assert!(text.contains("big_cores = [4, 5, 6, 7]"));
        assert!(profile_text("generic-aarch64").is_some());
        assert!(profile_text("no-such-board").is_none());
        let names: heapless::Vec<&str, 64> = profile_names().collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "profiles sorted by name: {names:?}");
    }
}
