//! Fuzzes `Gguf::parse` on arbitrary bytes; on success walks every accessor and checks the parser's
//! guarantees (data inside the file with exactly `nbytes` bytes, sizes consistent with the element
//! count and type, offsets aligned, no overlap). A panic anywhere is a finding.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The same invariant checker the integration tests use.
#[path = "../../tests/common/mod.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    match pinfer::gguf::Gguf::parse(data) {
        Ok(g) => common::check_parsed(&g, data),
        Err(e) => {
            common::describe(&e);
        }
    }
});
