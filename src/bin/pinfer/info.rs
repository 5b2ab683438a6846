//! `pinfer info`: what a model file holds, validated, without reading tensor data.

use std::collections::BTreeMap;
use std::path::Path;

use pinfer::gguf::{Gguf, TensorInfo};
use pinfer::loader::ModelFile;
use pinfer::model::{validate_vocab, HParams, Vocab};
use pinfer::placement::{self, Buffer, Placement, FORMATS};
use serde_json::{json, Value as Json};

use crate::runtime::{print_placement, resident_text, summary, summary_text, Runtime, RuntimeArgs};
use crate::CliError;

/// What `info` prints besides the summary.
pub struct InfoArgs {
    pub tensors: bool,
    pub json: bool,
    pub placement: bool,
    pub no_repack: bool,
}

/// Everything `info` reports, gathered once and printed as text or JSON.
struct Report<'a> {
    gguf: Gguf<'a>,
    file_bytes: usize,
    hparams: Option<HParams>,
    vocab: Option<Vocab<'a>>,
    /// The placement plan (with `--placement`): per tensor in file order, whether repacking is
    /// on, and a note when it was judged from names (no forward graph for this architecture yet).
    placement: Option<(Vec<Placement>, bool, Option<String>)>,
}

/// The placement of every tensor, as a session would decide it: from the decode graph's use of
/// each tensor, or from names and shapes for an architecture without a graph builder yet.
fn plan_placement(model: &ModelFile, gguf: &Gguf<'_>, repack: bool) -> (Vec<Placement>, Option<String>) {
    match pinfer::repack_cache::decode_placements(model, repack) {
        Ok(rows) => (rows, None),
        Err(e) => {
            let tied = gguf.tensor("output.weight").is_none();
            let rows = gguf
                .tensors()
                .map(|t| placement::place(&t, placement::use_by_name(&t, tied), repack))
                .collect();
            (rows, Some(format!("judged from tensor names and shapes, no forward graph: {e}")))
        }
    }
}

pub fn run(path: &Path, args: InfoArgs) -> Result<(), CliError> {
    let InfoArgs { tensors, json: as_json, placement, no_repack } = args;
    let model = ModelFile::open(path)?;
    let gguf = model.parse()?;
    let fail = |e: pinfer::model::ModelError| CliError::new(format!("{}: {e}", path.display()));
    // Files without tensors (vocabulary-only tokenizer test files, or bare metadata) are
    // described without hyper-parameters; a model with tensors must be complete.
    let (hparams, vocab) = if gguf.tensor_count() == 0 {
        let vocab = match gguf.get("tokenizer.ggml.model") {
            Some(_) => Some(validate_vocab(&gguf).map_err(fail)?),
            None => None,
        };
        (None, vocab)
    } else {
        if gguf.get("tokenizer.ggml.model").is_none() {
            return Err(CliError::new(format!(
                "{}: the model has no tokenizer metadata (tokenizer.ggml.model)",
                path.display()
            )));
        }
        let checked = pinfer::model::check(&gguf).map_err(fail)?;
        (Some(checked.hparams), Some(checked.vocab))
    };
    let repack = crate::runtime::repack_allowed() && !no_repack;
    let placement = match (&hparams, placement) {
        (Some(_), true) => {
            let (rows, note) = plan_placement(&model, &gguf, repack);
            Some((rows, repack, note))
        }
        (None, true) => return Err(CliError::new(format!("{}: no tensors to place", path.display()))),
        _ => None,
    };
    let report = Report { gguf, file_bytes: model.bytes().len(), hparams, vocab, placement };
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&report.to_json(path, tensors)).unwrap_or_default())?;
    } else {
        report.print(path, tensors)?;
    }
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn shape(t: &TensorInfo<'_>) -> Vec<u64> {
    t.ne[..t.n_dims as usize].to_vec()
}

impl Report<'_> {
    /// Per type: (tensor count, bytes, elements), sorted by bytes descending.
    fn quant_mix(&self) -> Vec<(&'static str, u64, u64, u64)> {
        let mut mix: BTreeMap<&'static str, (u64, u64, u64)> = BTreeMap::new();
        for t in self.gguf.tensors() {
            let e = mix.entry(t.ty.name()).or_default();
            *e = (e.0 + 1, e.1 + t.nbytes, e.2 + t.n_elements());
        }
        let mut v: Vec<_> = mix.into_iter().map(|(k, (n, b, e))| (k, n, b, e)).collect();
        v.sort_by_key(|e| core::cmp::Reverse(e.2));
        v
    }

    fn totals(&self) -> (u64, u64) {
        self.gguf.tensors().fold((0, 0), |(b, e), t| (b + t.nbytes, e + t.n_elements()))
    }

    fn str_key(&self, key: &str) -> Option<&str> {
        self.gguf.get_str_opt(key).ok().flatten()
    }

    fn special_id(&self, key: &str) -> Option<u64> {
        self.gguf.get_int::<u64>(key).ok().flatten()
    }

    fn print(&self, path: &Path, tensors: bool) -> Result<(), CliError> {
        let h = self.gguf.header();
        let (bytes, params) = self.totals();
        outln!("file:          {}", path.display())?;
        outln!(
            "format:        GGUF v{}, {:.2} MiB, {} tensors, {} metadata keys, alignment {}",
            h.version,
            mib(self.file_bytes as u64),
            h.tensor_count,
            h.kv_count,
            self.gguf.alignment()
        )?;
        outln!("architecture:  {}", self.str_key("general.architecture").unwrap_or("(none)"))?;
        if pinfer::repack_cache::is_cache(&self.gguf) {
            let layout = self.gguf.get_int::<u64>(pinfer::repack_cache::KEY_LAYOUT).ok().flatten();
            let listed = self.str_key(pinfer::repack_cache::KEY_TENSORS).map_or(0, |s| s.lines().count());
            outln!(
                "repack cache:  pinfer packed layout {} for {}, {listed} matrices repacked (sizes below are \
                 the GGUF types', not the planes')",
                layout.map_or("?".to_string(), |v| v.to_string()),
                self.str_key(pinfer::repack_cache::KEY_ARCH).unwrap_or("?")
            )?;
        }
        if let Some(name) = self.str_key("general.name") {
            outln!("name:          {name}")?;
        }
        if h.tensor_count > 0 {
            outln!(
                "size:          {:.2} MiB of weights, {:.2} M parameters, {:.2} bits per weight",
                mib(bytes),
                params as f64 / 1e6,
                bytes as f64 * 8.0 / params.max(1) as f64
            )?;
            let mix: Vec<String> = self
                .quant_mix()
                .iter()
                .map(|(ty, n, b, _)| format!("{ty} {n} tensors ({:.2} MiB)", mib(*b)))
                .collect();
            outln!("quant mix:     {}", mix.join(", "))?;
        }
        if let Some(hp) = &self.hparams {
            outln!(
                "layers:        {} (embedding {}, feed-forward {}, context {})",
                hp.n_layer,
                hp.n_embd,
                hp.n_ff,
                hp.n_ctx_train
            )?;
            if hp.arch.traits().encoder {
                // An encoder has absolute positions and LayerNorms, no RoPE or RMS norms.
                outln!(
                    "attention:     {} heads, {} kv heads, head dim {}/{}, bidirectional, layer norm eps {:e}",
                    hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, hp.rms_eps
                )?;
                let pooling = hp.pooling.map_or("none", |p| p.name());
                outln!("embeddings:    pooling {pooling} (the file's; --pooling overrides)")?;
            } else {
                outln!(
                    "attention:     {} heads, {} kv heads, head dim {}/{}, rope dims {}, freq base {}, rms eps {:e}{}",
                    hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, hp.n_rot, hp.rope_freq_base, hp.rms_eps,
                    if hp.arch.traits().bidirectional { ", bidirectional" } else { "" }
                )?;
                if hp.embeds() {
                    // A decoder-shaped embedder (Qwen3-Embedding, EmbeddingGemma).
                    let pooling = hp.pooling.map_or("none", |p| p.name());
                    outln!("embeddings:    pooling {pooling} (the file's; --pooling overrides)")?;
                }
            }
            if hp.n_expert > 0 {
                outln!(
                    "experts:       {} ({} used per token, width {}, shared width {})",
                    hp.n_expert,
                    hp.n_expert_used,
                    hp.n_ff_expert,
                    hp.n_ff_shared
                )?;
            }
            if hp.sliding_window > 0 {
                let layers = (0..hp.n_layer as usize).filter(|&il| hp.is_sliding(il)).count();
                outln!(
                    "sliding window: {} ({} layers, head dim {}/{}, rope dims {}, freq base {})",
                    hp.sliding_window,
                    layers,
                    hp.head_dim_k_swa,
                    hp.head_dim_v_swa,
                    hp.n_rot_swa,
                    hp.rope_freq_base_swa
                )?;
            }
            if hp.n_layer_kv < hp.n_layer {
                outln!(
                    "shared KV:     layers {}..{} read earlier layers' caches",
                    hp.n_layer_kv,
                    hp.n_layer - 1
                )?;
            }
            if hp.n_embd_per_layer > 0 {
                outln!("per-layer inputs: {} per layer and token", hp.n_embd_per_layer)?;
            }
            if hp.final_logit_softcap > 0.0 {
                outln!("logit softcap: {}", hp.final_logit_softcap)?;
            }
        }
        if let Some(v) = &self.vocab {
            let id = |k: &str| self.special_id(k).map_or("-".to_string(), |i| i.to_string());
            outln!(
                "tokenizer:     {} (pre {}), {} tokens, {} merges, bos {}, eos {}, chat template {}",
                v.model,
                v.pre.unwrap_or("default"),
                v.n_vocab,
                v.n_merges,
                id("tokenizer.ggml.bos_token_id"),
                id("tokenizer.ggml.eos_token_id"),
                if self.gguf.get("tokenizer.chat_template").is_some() { "yes" } else { "no" }
            )?;
        }
        if let Some((rows, repack, note)) = &self.placement {
            outln!()?;
            let note = note.as_ref().map_or(String::new(), |n| format!("; {n}"));
            outln!(
                "placement (repacking {}; kernels {}{note}):",
                if *repack { "on" } else { "off" },
                crate::chosen_kernels(None).map_or("?", |p| p.name())
            )?;
            let rows = || self.gguf.tensors().zip(rows.iter().copied());
            print_placement(rows(), &mut std::io::stdout()).map_err(crate::streams::stdout_error)?;
            outln!("buffers: {}", summary_text(&summary(rows())))?;
            outln!("file -> resident: {}", resident_text(rows()))?;
        }
        if tensors {
            outln!()?;
            outln!("{:<40} {:>8} {:>24} {:>12}", "tensor", "type", "shape", "bytes")?;
            for t in self.gguf.tensors() {
                let dims: Vec<String> = shape(&t).iter().map(u64::to_string).collect();
                outln!("{:<40} {:>8} {:>24} {:>12}", t.name, t.ty.name(), dims.join(" x "), t.nbytes)?;
            }
        }
        Ok(())
    }

    fn to_json(&self, path: &Path, tensors: bool) -> Json {
        let h = self.gguf.header();
        let (bytes, params) = self.totals();
        let mut out = json!({
            "file": path.display().to_string(),
            "file_bytes": self.file_bytes,
            "gguf_version": h.version,
            "tensor_count": h.tensor_count,
            "metadata_count": h.kv_count,
            "alignment": self.gguf.alignment(),
            "architecture": self.str_key("general.architecture"),
            "name": self.str_key("general.name"),
            "weight_bytes": bytes,
            "parameters": params,
            "quant_mix": self.quant_mix().iter().map(|(ty, n, b, e)| json!({
                "type": ty, "tensors": n, "bytes": b, "elements": e
            })).collect::<Vec<_>>(),
        });
        if let Some(hp) = &self.hparams {
            out["hparams"] = json!({
                "n_layer": hp.n_layer, "n_embd": hp.n_embd, "n_ff": hp.n_ff, "n_ctx_train": hp.n_ctx_train,
                "n_head": hp.n_head, "n_head_kv": hp.n_head_kv, "head_dim_k": hp.head_dim_k,
                "head_dim_v": hp.head_dim_v, "n_rot": hp.n_rot, "rope_freq_base": hp.rope_freq_base,
                "rope_freq_scale": hp.rope_freq_scale, "rms_eps": hp.rms_eps, "n_expert": hp.n_expert,
                "n_expert_used": hp.n_expert_used, "n_ff_expert": hp.n_ff_expert,
                "n_ff_shared": hp.n_ff_shared, "sliding_window": hp.sliding_window,
                "n_layer_kv": hp.n_layer_kv, "n_embd_per_layer": hp.n_embd_per_layer,
                "final_logit_softcap": hp.final_logit_softcap,
            });
        }
        if let Some(v) = &self.vocab {
            out["tokenizer"] = json!({
                "model": v.model, "pre": v.pre, "n_vocab": v.n_vocab, "n_merges": v.n_merges,
                "bos_token_id": self.special_id("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self.special_id("tokenizer.ggml.eos_token_id"),
                "has_chat_template": self.gguf.get("tokenizer.chat_template").is_some(),
            });
        }
        if let Some((rows, repack, note)) = &self.placement {
            let s = summary(self.gguf.tensors().zip(rows.iter().copied()));
            let layouts: serde_json::Map<String, Json> = FORMATS
                .iter()
                .zip(&s.repacked)
                .filter(|(_, (n, _))| *n > 0)
                .map(|(f, (n, b))| (f.name().to_string(), json!({"tensors": n, "bytes": b})))
                .collect();
            let (n_rep, b_rep) = s.repacked_total();
            out["placement"] = json!({
                "repack": repack,
                "note": note,
                "tensors": self.gguf.tensors().zip(rows).map(|(t, p)| json!({
                    "name": t.name,
                    "type": t.ty.name(),
                    "buffer": match p.buffer { Buffer::Repacked(_) => "repacked", Buffer::Mapped => "mapped", Buffer::Npu(_) => "npu" },
                    "layout": match p.buffer { Buffer::Repacked(f) => Some(f.name()), Buffer::Mapped | Buffer::Npu(_) => None },
                    "bytes": p.bytes,
                    "reason": p.reason.to_string(),
                })).collect::<Vec<_>>(),
                "buffers": {
                    "repacked": {"tensors": n_rep, "bytes": b_rep, "layouts": layouts},
                    "mapped": {"tensors": s.mapped.0, "bytes": s.mapped.1},
                    "tied_embedding_rows": {"tensors": s.mapped_rows.0, "bytes": s.mapped_rows.1},
                    "npu": {"tensors": s.npu.0, "bytes": s.npu.1, "note": "nothing is planned for it here: `pinfer npu-plan` lists the NPU copies of matmul weights (kept next to their CPU copies)"},
                },
            });
        }
        if tensors {
            out["tensors"] = self
                .gguf
                .tensors()
                .map(|t| json!({"name": t.name, "type": t.ty.name(), "shape": shape(&t), "bytes": t.nbytes, "offset": t.offset}))
                .collect();
        }
        out
    }
}

/// `pinfer boards`: the embedded profiles, and what `--board auto` (or the given board and
/// options) chooses on this machine.
pub fn boards(args: &RuntimeArgs) -> Result<(), CliError> {
    use pinfer::board::runtime::{list, ranges};
    outln!(
        "{:<18} {:<20} {:<15} {:>9} {:>9} {:>4} {:>7}  ram",
        "board",
        "name",
        "soc",
        "big",
        "little",
        "npu",
        "threads"
    )?;
    for p in pinfer::board::profiles() {
        let p = p.map_err(|e| CliError::new(format!("a board profile does not parse: {e}")))?;
        let cores = |c: &[u16]| {
            if c.is_empty() {
                "-".to_string()
            } else {
                ranges(&c.iter().map(|&c| usize::from(c)).collect::<Vec<_>>())
            }
        };
        outln!(
            "{:<18} {:<20} {:<15} {:>9} {:>9} {:>4} {:>7}  {}",
            p.id,
            p.name,
            p.soc,
            cores(&p.big_cores),
            cores(&p.little_cores),
            p.npu_cores,
            p.recommended_threads,
            p.ram_notes
        )?;
    }
    let rt = Runtime::new(args)?;
    outln!()?;
    outln!("this machine: {} ({}, {})", rt.board.profile.name, rt.board.profile.id, rt.board.how)?;
    outln!("workers: {} on cores {}", rt.workers.cores.len(), list(&rt.workers.cores))?;
    let facts = pinfer::board::runtime::facts(Path::new("/"), &rt.workers.cores);
    outln!(
        "cpu governor {}, cpu {}, ddr {}",
        facts.governor.as_deref().unwrap_or("-"),
        facts.cpu_freq_text(),
        facts.ddr_mhz.map_or("-".to_string(), |m| format!(
            "{m} MHz ({})",
            facts.ddr_governor.as_deref().unwrap_or("-")
        ))
    )?;
    Ok(())
}
