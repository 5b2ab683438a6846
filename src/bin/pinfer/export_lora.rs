//! `pinfer export-lora -m BASE --lora FILE [--lora-scaled FILE SCALE] -o OUT`: merge LoRA adapters
//! into a new GGUF, as llama.cpp's llama-export-lora does.
//!
//! Every adapted weight becomes `W + Σ scale_i B_i A_i` (dequantized to f32, the adapters' terms
//! added in the order given) stored as F16 (F32 when the base weight is F32), or as `--type TYPE`
//! (one of `pinfer quantize`'s types) to keep a board-sized file; every other tensor and all
//! metadata are copied (`general.file_type` says F16 when F16 is written). The output goes to a
//! temporary file beside OUT, is checked, then renamed over OUT (the inputs are never touched).

use std::borrow::Cow;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use pinfer::gguf::write::TensorHeader;
use pinfer::gguf::{Gguf, TensorInfo};
use pinfer::loader::ModelFile;
use pinfer::model::lora::{add_product, Adapter};
use pinfer::model::HParams;
use pinfer::output_file::OutputFile;
use pinfer::quant::quantize::quantize_row_ref;
use pinfer::quant::{dequantize_row_ref, GgmlType};

use crate::quantize::{output_metadata, parse_target, write_gguf};
use crate::CliError;

/// Options of `pinfer export-lora`.
#[derive(Args, Debug)]
pub struct ExportLoraArgs {
    /// The base model.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// An adapter to merge at scale 1 (repeatable).
    #[arg(long = "lora", value_name = "FILE")]
    pub lora: Vec<PathBuf>,
    /// An adapter to merge with a scale of its product (repeatable).
    #[arg(long = "lora-scaled", value_names = ["FILE", "SCALE"], num_args = 2)]
    pub lora_scaled: Vec<String>,
    /// The merged model.
    #[arg(short = 'o', long = "output", visible_alias = "output-file")]
    pub output: PathBuf,
    /// Store the merged weights as this type (F32, F16, or one of `quantize`'s types; default
    /// F16, F32 for F32 weights).
    #[arg(long = "type", value_name = "TYPE")]
    pub ty: Option<String>,
}

/// llama.cpp's file type of an F16 model.
const FILE_TYPE_F16: u32 = 1;

pub fn run(args: ExportLoraArgs) -> Result<(), CliError> {
    let start = Instant::now();
    let files = crate::runtime::adapter_files(&args.lora, &args.lora_scaled)?;
    if files.is_empty() {
        return Err(CliError::new("export-lora needs at least one adapter (--lora or --lora-scaled)".into()));
    }
    // (llama.cpp's file types of F32 and F16 models: 0 and 1.)
    let target = match args.ty.as_deref() {
        Some(t) if t.eq_ignore_ascii_case("f32") => Some((GgmlType::F32, 0)),
        Some(t) if t.eq_ignore_ascii_case("f16") => Some((GgmlType::F16, FILE_TYPE_F16)),
        other => other.map(parse_target).transpose()?,
    };

    let base_file = ModelFile::open(&args.model)?;
    let base = base_file.parse()?;
    let base_name = args.model.display();
    if pinfer::repack_cache::is_cache(&base) {
        return Err(CliError::new(format!(
            "{base_name} is a pinfer repack cache: merge into the original GGUF"
        )));
    }
    let hp = HParams::from_gguf(&base).map_err(|e| CliError::new(format!("{base_name}: {e}")))?;
    let mut adapter_files = Vec::with_capacity(files.len());
    for (path, _) in &files {
        adapter_files.push(ModelFile::open(path)?);
    }
    let mut adapters = Vec::with_capacity(files.len());
    for ((path, user_scale), file) in files.iter().zip(&adapter_files) {
        let fail = |e: String| CliError::new(format!("LoRA adapter {}: {e}", path.display()));
        let gguf = file.parse()?;
        let adapter =
            Adapter::new(file.bytes(), &gguf, &base, &hp, *user_scale).map_err(|e| fail(e.to_string()))?;
        adapters.push(adapter);
    }

    let tensors: Vec<TensorInfo<'_>> = base.tensors().collect();
    if tensors.len() != base.tensor_count() {
        return Err(CliError::new(format!("{base_name}: could not read every tensor info")));
    }
    let adapted = |t: &TensorInfo<'_>| adapters.iter().any(|a| a.lora.pair(t.name).is_some());
    let out_type = |t: &TensorInfo<'_>| match target {
        Some((ty, _)) if t.ne[0] % ty.block_len() as u64 == 0 => ty,
        _ if t.ty == GgmlType::F32 => GgmlType::F32,
        _ => GgmlType::F16,
    };
    let headers: Vec<TensorHeader<'_>> = tensors
        .iter()
        .map(|t| TensorHeader::retyped(t, if adapted(t) { out_type(t) } else { t.ty }))
        .collect();
    let merged = tensors.iter().filter(|t| adapted(t)).count();
    let mut merged_types: Vec<&str> =
        tensors.iter().zip(&headers).filter(|(t, _)| adapted(t)).map(|(_, h)| h.ty.name()).collect();
    merged_types.sort_unstable();
    merged_types.dedup();
    // (F32 weights merged as F32 leave the file type as it was.)
    let file_type = match target {
        Some((_, ft)) => ft,
        None if merged_types.contains(&"F16") => FILE_TYPE_F16,
        None => base.get_u32("general.file_type").unwrap_or(0),
    };
    let metadata = output_metadata(&base, file_type)?;

    let _polled = crate::signals::Polled::start();
    let mut inputs: Vec<&std::path::Path> = vec![&args.model];
    inputs.extend(files.iter().map(|(p, _)| p.as_path()));
    let mut out = OutputFile::create(&args.output, &inputs)?;
    let out_bytes = write_gguf(&mut out, &metadata, &headers, |i| {
        let t = &tensors[i];
        if !adapted(t) {
            return Ok(Cow::Borrowed(base.tensor_data(t)));
        }
        merge(&base, t, &adapters, headers[i].ty).map(Cow::Owned)
    })?;
    crate::signals::check_interrupt()?;
    out.commit()?;
    outln!(
        "merged {} adapter(s) into {base_name} -> {}: {merged} weights merged ({}), {} copied; {:.2} MiB in {:.1} s",
        adapters.len(),
        args.output.display(),
        merged_types.join(", "),
        tensors.len() - merged,
        out_bytes as f64 / (1024.0 * 1024.0),
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}

/// The values of tensor `t` of file `gguf` (or of an adapter's bytes), as f32.
fn values(ty: GgmlType, bytes: &[u8], n: usize, name: &str) -> Result<Vec<f32>, CliError> {
    let mut out = vec![0f32; n];
    dequantize_row_ref(ty, bytes, &mut out).map_err(|e| CliError::new(format!("{name}: {e}")))?;
    Ok(out)
}

/// Weight `t` with every adapter's term added, as `ty`'s bytes.
fn merge(
    gguf: &Gguf<'_>,
    t: &TensorInfo<'_>,
    adapters: &[Adapter<'_>],
    ty: GgmlType,
) -> Result<Vec<u8>, CliError> {
    let (n_in, n_out) = (t.ne[0] as usize, t.ne[1] as usize);
    let mut w = values(t.ty, gguf.tensor_data(t), n_in * n_out, t.name)?;
    for adapter in adapters {
        let Some(pair) = adapter.lora.pair(t.name) else { continue };
        let rank = adapter.lora.rank as usize;
        let data = |x: &TensorInfo<'_>| {
            adapter
                .data(x)
                .ok_or_else(|| CliError::new(format!("{}: its data lies outside the file", x.name)))
        };
        let a = values(pair.a.ty, data(&pair.a)?, n_in * rank, pair.a.name)?;
        let b = values(pair.b.ty, data(&pair.b)?, rank * n_out, pair.b.name)?;
        add_product(&mut w, &a, &b, n_in, rank, adapter.scale);
    }
    if w.iter().any(|v| !v.is_finite()) {
        return Err(CliError::new(format!("{}: the merged weight is not finite", t.name)));
    }
    Ok(match ty {
        GgmlType::F32 => bytemuck::cast_slice(&w).to_vec(),
        GgmlType::F16 => w.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        ty => {
            let row_bytes = ty.bytes_for(n_in as u64).unwrap_or(0) as usize;
            let mut out = vec![0u8; row_bytes * n_out];
            for (row, dst) in w.chunks_exact(n_in).zip(out.chunks_exact_mut(row_bytes)) {
                quantize_row_ref(ty, row, dst).map_err(|e| CliError::new(format!("{}: {e}", t.name)))?;
            }
            out
        }
    })
}
