//! The LoRA training graph of a llama model (`pinfer::train::lora`): with `B = 0` its logits are
//! the inference engine's (the same blocks over the window: equal on the reference kernels with an
//! F32 cache), only `B` has a gradient then, and Adam on the adapters alone fits a
//! sequence (the loss halves) while the frozen weights stay as they are in the file.

#[path = "common/lora_graph.rs"]
mod lora_graph;

use lora_graph::{at_the_start, model_bytes, ALL_TARGETS};
use pinfer::model::HParams;
use pinfer::train::optim::Adam;

const TOKENS: [u32; 12] = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 1797, 1918, 553];
const MODEL: &str = "tiny/llama-untied-q5.gguf";

// (On the default test thread: the engine's graph slots and the bound graph's address table are
// on the heap.)
#[test]
fn the_lora_graph_computes_the_model_and_adam_fits_the_adapters() {
    let bytes = model_bytes(MODEL);
    let hp = HParams::from_gguf(&pinfer::gguf::Gguf::parse(&bytes).unwrap()).unwrap();
    let n = TOKENS.len();
    // Next-token targets; the first two positions are not scored (a prompt), nor the last.
    let targets: Vec<i32> =
        (0..n).map(|t| if t < 2 || t + 1 == n { -1 } else { TOKENS[t + 1] as i32 }).collect();
    // The graph computes the model at the start (A random, B zero), only B has gradients.
    at_the_start::<{ pinfer::build_config::GRAPH_CAPACITY }, _>(
        MODEL,
        &bytes,
        &TOKENS,
        &targets,
        ALL_TARGETS,
        |start| {
            assert_eq!(start.lora.adapted.len(), 7 * hp.n_layer as usize);
            // Adam on the adapters: the loss on this sequence falls.
            let (first, mut x) = (start.loss, start.x);
            let adam = Adam { lr: 1e-2, max_iterations: 12, grad_tolerance: 0.0, ..Adam::default() };
            let mut work = vec![0.0; Adam::work_len(x.len())];
            let report = adam.minimize(start.objective, &mut x, &mut work, &mut |_, _| {}).unwrap();
            eprintln!("loss {first} -> {} in {} Adam steps", report.loss, report.iterations);
            assert!(report.loss < 0.5 * first, "the loss went from {first} to {}", report.loss);
        },
    );
}
