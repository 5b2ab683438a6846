//! Mixture-of-experts models end to end: a broken router stops generation with an error that
//! names its layer (the golden outputs are in tests/golden.rs, the kernels in tests/graph_ops.rs).

use std::path::{Path, PathBuf};

use pinfer::loader::ModelFile;
use pinfer::session::{Session, SessionOptions};

fn model_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
}

/// qwen3moe-tiny with every router weight of layer `layer` set to `value`.
fn poisoned_router(dir: &Path, layer: usize, value: f32) -> PathBuf {
    let original = std::fs::read(model_path("tiny/qwen3moe-tiny.gguf")).unwrap();
    let mut bytes = original.clone();
    let g = pinfer::gguf::Gguf::parse(&original).unwrap();
    let t = g.tensor(&format!("blk.{layer}.ffn_gate_inp.weight")).unwrap();
    let start = g.data_start() + t.offset as usize;
    for v in bytes[start..start + t.nbytes as usize].chunks_mut(4) {
        v.copy_from_slice(&value.to_le_bytes());
    }
    let path = dir.join(format!("router-{layer}-{value}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_non_finite_router_stops_generation_naming_the_layer() {
    // (A scratch directory of the test's own, removed when it ends.)
    let scratch = std::env::temp_dir().join(format!("pinfer-moe-test-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let _cleanup = RemoveOnDrop(scratch.clone());
    for (layer, value) in [(1, f32::NAN), (2, f32::INFINITY)] {
        for repack in [true, false] {
            let path = poisoned_router(&scratch, layer, value);
            let model = ModelFile::open_static(&path).unwrap();
            let opts = SessionOptions { threads: 2, n_ctx: 64, repack, ..Default::default() };
            let mut session = Session::new(model, &opts).unwrap();
            let err = session.eval(&[1, 2, 3]).map(|_| ()).unwrap_err().to_string();
            assert!(
                err.contains(&format!("MoE router of layer {layer} produced a non-finite value"))
                    && err.contains(&format!("ffn_moe_topk-{layer}")),
                "layer {layer}, {value}, repack {repack}: {err}"
            );
        }
    }
}

/// Removes a directory when dropped (when the test ends, passed or failed).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
