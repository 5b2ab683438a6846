//! The language side of a vision-language model against llama-mtmd-cli (tests/golden/vision):
//! the prompt's text chunks as tokens, each image chunk as the projector's embeddings fed to the
//! decoder batch (Gemma 3's attending both ways within the image), then greedy decoding: the
//! same ids as llama.cpp. Embeddings come from pinfer's own projector (engine::vision), so the
//! whole path is pinfer's; libmtmd's embeddings are checked in tests/vision_golden.rs.

use std::path::PathBuf;

use pinfer::engine::vision::VisionPlanned;
use pinfer::engine::{Entry, OnCaller};
use pinfer::image::{decode, preprocess, ImageLimits};
use pinfer::loader::ModelFile;
use pinfer::session::{Session, SessionOptions};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn argmax(logits: &[f32]) -> u32 {
    // Lowest id wins ties, as llama.cpp's greedy sampler.
    logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best }) as u32
}

/// Runs the golden's prompt for `family` and `image` through pinfer and returns the greedy ids.
fn greedy_after_image(family: &str, image: &str, session: &mut Session) -> (Vec<u32>, Vec<u32>) {
    let stem = image.rsplit_once('.').unwrap().0;
    let golden: Value = serde_json::from_slice(
        &std::fs::read(root().join("tests/golden/vision").join(family).join(format!("{stem}.json"))).unwrap(),
    )
    .unwrap();
    let dir = root().join("models/tiny-vlm").join(family);
    let mmproj = std::fs::read(dir.join("mmproj.gguf")).unwrap();
    let bytes = std::fs::read(root().join("tests/vision/images").join(image)).unwrap();
    let rgb = decode(&bytes, ImageLimits::default()).unwrap();
    let vp = pinfer::model::vision::check_projector(&pinfer::gguf::Gguf::parse(&mmproj).unwrap()).unwrap();
    let pre = preprocess(&rgb, &vp).unwrap();
    let mut slot = pinfer::engine::heap::slots(1).unwrap();
    let mut embeddings = Vec::new();
    for input in &pre.images {
        let (w, h) = (input.width as usize, input.height as usize);
        let planned = VisionPlanned::new(&mmproj, &mut slot[0], w, h).unwrap();
        let memory = vec![0u8; planned.bytes_needed()];
        let mut engine = planned.bind(memory).unwrap();
        embeddings.extend_from_slice(engine.encode(&input.pixels, w, h, &OnCaller).unwrap());
    }
    let _ = session.truncate(0);
    let causal = !vp.traits().bidirectional_image;
    let mut images = 0;
    for chunk in golden["chunks"].as_array().unwrap() {
        match chunk["type"].as_str().unwrap() {
            "text" => {
                let tokens: Vec<u32> =
                    chunk["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
                let start = session.seq_len(0);
                assert_eq!(
                    start as u64,
                    chunk["pos_start"].as_u64().unwrap(),
                    "{family} {image}: text chunk position"
                );
                for (i, part) in tokens.chunks(session.n_batch()).enumerate() {
                    let at = start + i * session.n_batch();
                    let batch: Vec<Entry> = part
                        .iter()
                        .enumerate()
                        .map(|(j, &token)| Entry { seq: 0, pos: at + j, token, logits: j + 1 == part.len() })
                        .collect();
                    session.decode(&batch).unwrap();
                }
            }
            "image" => {
                let n = chunk["n_tokens"].as_u64().unwrap() as usize;
                let width = vp.n_embd_out as usize;
                assert_eq!(session.seq_len(0) as u64, chunk["pos_start"].as_u64().unwrap());
                session
                    .decode_embeddings(0, &embeddings[images * width..(images + n) * width], causal)
                    .unwrap();
                images += n;
            }
            other => panic!("chunk type {other}"),
        }
    }
    assert_eq!(images * vp.n_embd_out as usize, embeddings.len(), "{family} {image}: every embedding placed");
    let want: Vec<u32> =
        golden["greedy_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let mut got = Vec::new();
    let mut next = argmax(session.logits(0).unwrap());
    for _ in 0..want.len() {
        got.push(next);
        let pos = session.seq_len(0);
        session.decode(&[Entry { seq: 0, pos, token: next, logits: true }]).unwrap();
        next = argmax(session.logits(0).unwrap());
    }
    (got, want)
}

fn open(family: &str, n_batch: usize) -> Session {
    let path = root().join("models/tiny-vlm").join(family).join("model.gguf");
    let model = ModelFile::open_static(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/setup.sh tiny-vlm)", path.display()));
    let opts =
        SessionOptions { n_ctx: 4096, n_batch, threads: 2, embeddings_input: true, ..Default::default() };
    Session::new(model, &opts).unwrap()
}

#[test]
fn gemma3_greedy_ids_after_an_image_match_llama_mtmd_cli() {
    let mut session = open("gemma3", 64);
    for image in ["rgb_1x1.png", "rgb_3000x200.png", "gray_37x53.png", "rgba_41x29.png", "palette_33x47.png"]
    {
        let (got, want) = greedy_after_image("gemma3", image, &mut session);
        assert_eq!(got, want, "gemma3 {image}");
    }
}

#[test]
fn idefics3_greedy_ids_after_an_image_match_llama_mtmd_cli() {
    let mut session = open("idefics3", 64);
    for image in ["rgb_1x1.png", "rgb_3000x200.png", "gray_37x53.png", "rgba_41x29.png", "palette_33x47.png"]
    {
        let (got, want) = greedy_after_image("idefics3", image, &mut session);
        assert_eq!(got, want, "idefics3 {image}");
    }
}
