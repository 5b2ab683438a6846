//! `pinfer quantize IN OUT TYPE`: requantize a model's weight matrices into a new GGUF file.
//!
//! Which tensors change: every weight matrix (two or more dimensions, a name ending in `weight`;
//! MoE routers `*ffn_gate_inp*` and an encoder's `position_embd`/`token_types` excepted, they
//! stay in float) whose rows are a whole number of
//! TYPE's blocks is dequantized to f32 and requantized to TYPE with pinfer's reference quantizers,
//! which follow ggml's `quantize_row_*_ref` (what `llama-quantize` does without an importance
//! matrix). A matrix whose rows do not divide into 256-element super-blocks falls back to Q8_0
//! (as llama.cpp does for Q6_K), or stays as it is if they do not divide into 32 either. A matrix
//! already of its output type is copied unchanged (requantizing could only lose accuracy), and so
//! are all other tensors (norms, biases, routers).
//!
//! The output is GGUF v3 with the input's metadata, unchanged except `general.file_type` (the
//! llama.cpp file type of TYPE; added if absent, with `general.quantization_version` 2 if that is
//! absent too), the input's alignment, and the tensors in the input's order. It is written to a
//! new temporary file beside OUT, checked with pinfer's parser, then renamed over OUT
//! (`pinfer::output_file`: the input, devices and links are never overwritten).

use std::borrow::Cow;
use std::io::BufWriter;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use pinfer::gguf::write::{GgufWriter, TensorHeader};
use pinfer::gguf::{Gguf, TensorInfo, Value};
use pinfer::loader::ModelFile;
use pinfer::output_file::OutputFile;
use pinfer::quant::quantize::quantize_row_ref;
use pinfer::quant::{dequantize_row_ref, GgmlType, QuantError};

use crate::CliError;

/// Options of `pinfer quantize`.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Input GGUF.
    pub input: PathBuf,
    /// Output GGUF.
    pub output: PathBuf,
    /// Target type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q6_K.
    pub ty: String,
    /// Threads for the conversion (default: every core this process may use).
    #[arg(short = 't', long = "threads", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
}

/// The target types with their llama.cpp file type: every type with a quantizer and a file type of
/// its own (Q8_K, an activation type, has none; Q4_K's is Q4_K_S, the mix where every matrix is Q4_K).
fn targets() -> impl Iterator<Item = (GgmlType, u32)> {
    GgmlType::all().filter(|t| t.traits().quantize.is_some()).filter_map(|t| Some((t, t.file_type()?)))
}

/// Where a matrix goes when its rows do not divide into the target's blocks.
const FALLBACK: GgmlType = GgmlType::Q8_0;

pub(crate) fn parse_target(name: &str) -> Result<(GgmlType, u32), CliError> {
    targets().find(|(ty, _)| ty.name().eq_ignore_ascii_case(name)).ok_or_else(|| {
        let names: Vec<&str> = targets().map(|(ty, _)| ty.name()).collect();
        CliError::new(format!("unknown quantization type '{name}' (supported: {})", names.join(", ")))
    })
}

/// What happens to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Copied byte for byte.
    Copy,
    /// Dequantized and requantized to this type.
    Requantize(GgmlType),
}

/// Weight matrices that did not get the target type, for the notes on stderr.
#[derive(Default)]
struct Notes {
    /// Rows not a multiple of the target's block, stored as [`FALLBACK`]: (tensor, row length).
    fallback: Vec<(String, u64)>,
    /// Rows not a multiple of 32 either, left as they are: (tensor, row length).
    kept: Vec<(String, u64)>,
    /// Types pinfer cannot dequantize, left as they are.
    unreadable: Vec<String>,
}

/// Tensors that are added to activations, not multiplied: an encoder's absolute positions and
/// token types stay in float, as llama-quantize keeps them (llama.cpp cannot add a quantized
/// tensor, so a file with them quantized would not load there).
const ADDED_NOT_MULTIPLIED: [&str; 2] = ["position_embd.weight", "token_types.weight"];

fn is_weight_matrix(t: &TensorInfo<'_>) -> bool {
    t.n_dims >= 2
        && t.name.ends_with("weight")
        && !t.name.contains("ffn_gate_inp")
        && !ADDED_NOT_MULTIPLIED.contains(&t.name)
}

/// The type the output projection gets for `target`: as llama-quantize does, a target narrower than
/// Q6_K keeps the output (or a tied embedding used as output) at 6 bits, or 8 when rows do not
/// divide into 256; it matters more than any other matrix for quality.
fn output_type(target: GgmlType, row: u64) -> GgmlType {
    let q6_k = GgmlType::Q6_K;
    // bits per weight, compared as cross products of the block sizes
    let narrower = target.block_bytes() * q6_k.block_len() < q6_k.block_bytes() * target.block_len();
    if !narrower {
        target
    } else if row % 256 == 0 {
        q6_k
    } else {
        GgmlType::Q8_0
    }
}

fn plan(t: &TensorInfo<'_>, target: GgmlType, is_output: bool, notes: &mut Notes) -> Plan {
    if !is_weight_matrix(t) {
        return Plan::Copy;
    }
    let row = t.ne[0];
    let target = if is_output { output_type(target, row) } else { target };
    let out_ty = if row % target.block_len() as u64 == 0 {
        target
    } else if row % FALLBACK.block_len() as u64 == 0 {
        notes.fallback.push((t.name.to_string(), row));
        FALLBACK
    } else {
        notes.kept.push((t.name.to_string(), row));
        return Plan::Copy;
    };
    if t.ty == out_ty {
        return Plan::Copy;
    }
    // An empty row asks only whether the type has a dequantizer.
    if let Err(QuantError::Unsupported(_)) = dequantize_row_ref(t.ty, &[], &mut []) {
        notes.unreadable.push(t.name.to_string());
        return Plan::Copy;
    }
    Plan::Requantize(out_ty)
}

/// Dequantizes each row of `src` (type `from`, rows of `row_len` elements) and quantizes it to `to`,
/// on up to `threads` threads.
fn requantize(
    src: &[u8],
    from: GgmlType,
    to: GgmlType,
    row_len: usize,
    threads: usize,
) -> Result<Vec<u8>, QuantError> {
    let bytes_of = |ty: GgmlType| ty.bytes_for(row_len as u64).map(|b| b as usize);
    let (Some(src_row), Some(dst_row)) = (bytes_of(from), bytes_of(to)) else {
        return Err(QuantError::LengthMismatch { ty: to, src_bytes: src.len(), out_len: row_len });
    };
    let n_rows = src.len() / src_row;
    let mut out = vec![0u8; n_rows * dst_row];
    let per_thread = n_rows.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let workers: Vec<_> = src
            .chunks(per_thread * src_row)
            .zip(out.chunks_mut(per_thread * dst_row))
            .map(|(src, out)| {
                s.spawn(move || {
                    let mut row = vec![0f32; row_len];
                    for (src, out) in src.chunks_exact(src_row).zip(out.chunks_exact_mut(dst_row)) {
                        dequantize_row_ref(from, src, &mut row)?;
                        quantize_row_ref(to, &row, out)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
    })?;
    Ok(out)
}

/// The input's metadata with `general.file_type` set (and `general.quantization_version` added if
/// missing).
pub(crate) fn output_metadata<'a>(
    gguf: &Gguf<'a>,
    file_type: u32,
) -> Result<Vec<(&'a str, Value<'a>)>, CliError> {
    let mut meta: Vec<(&'a str, Value<'a>)> = gguf.metadata().collect();
    if meta.len() as u64 != gguf.header().kv_count {
        return Err(CliError::new(format!(
            "could read only {} of the {} metadata values",
            meta.len(),
            gguf.header().kv_count
        )));
    }
    match meta.iter_mut().find(|(k, _)| *k == "general.file_type") {
        Some(kv) => kv.1 = Value::U32(file_type),
        None => meta.push(("general.file_type", Value::U32(file_type))),
    }
    if !meta.iter().any(|(k, _)| *k == "general.quantization_version") {
        meta.push(("general.quantization_version", Value::U32(2)));
    }
    Ok(meta)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `a, b, c, d and 7 more`.
fn some_names<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> String {
    const SHOWN: usize = 4;
    let more = names.len().saturating_sub(SHOWN);
    let mut text = names.take(SHOWN).collect::<Vec<_>>().join(", ");
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    text
}

fn print_notes(notes: &Notes, target: GgmlType) {
    let groups =
        [(&notes.fallback, format!("stored as {FALLBACK}")), (&notes.kept, "left as they are".into())];
    for (group, what) in groups {
        if group.is_empty() {
            continue;
        }
        let mut lens: Vec<u64> = group.iter().map(|(_, row)| *row).collect();
        lens.sort_unstable();
        lens.dedup();
        let lens: Vec<String> = lens.iter().map(u64::to_string).collect();
        errln!(
            "note: {} matrices have rows of {} elements, not a multiple of {target}'s block of {}: {what} ({})",
            group.len(),
            lens.join(", "),
            target.block_len(),
            some_names(group.iter().map(|(name, _)| name.as_str()))
        );
    }
    if !notes.unreadable.is_empty() {
        errln!(
            "note: {} matrices have types pinfer cannot dequantize and are left as they are ({})",
            notes.unreadable.len(),
            some_names(notes.unreadable.iter().map(String::as_str))
        );
    }
}

/// Runs the conversion.
pub fn run(args: QuantizeArgs) -> Result<(), CliError> {
    let (target, file_type) = parse_target(&args.ty)?;
    let start = Instant::now();
    let model = ModelFile::open(&args.input)?;
    let gguf = model.parse()?;
    let input_name = args.input.display();
    if pinfer::repack_cache::is_cache(&gguf) {
        return Err(CliError::new(format!(
            "{input_name} is a pinfer repack cache (weights in pinfer's packed layout): quantize the original GGUF"
        )));
    }

    let mut notes = Notes::default();
    let tensors: Vec<TensorInfo<'_>> = gguf.tensors().collect();
    if tensors.len() != gguf.tensor_count() {
        return Err(CliError::new(format!("{input_name}: could not read every tensor info")));
    }
    // The output projection: `output.weight`, or the token embedding when the model ties them.
    let has_output = tensors.iter().any(|t| t.name == "output.weight");
    let is_output =
        |t: &TensorInfo<'_>| t.name == "output.weight" || (!has_output && t.name == "token_embd.weight");
    let plans: Vec<Plan> = tensors.iter().map(|t| plan(t, target, is_output(t), &mut notes)).collect();
    let headers: Vec<TensorHeader<'_>> = tensors
        .iter()
        .zip(&plans)
        .map(|(t, p)| TensorHeader::retyped(t, if let Plan::Requantize(ty) = *p { ty } else { t.ty }))
        .collect();
    let metadata = output_metadata(&gguf, file_type)?;
    print_notes(&notes, target);

    let _polled = crate::signals::Polled::start();
    let mut out = OutputFile::create(&args.output, &[&args.input])?;
    let threads = crate::worker_threads(args.threads);
    let out_bytes = write_output(&mut out, &gguf, &tensors, &plans, &headers, &metadata, threads)?;
    // A Ctrl-C during the flush and the check still leaves the output as it was.
    crate::signals::check_interrupt()?;
    out.commit()?;

    let (mut to_target, mut to_fallback, mut copied) = (0, 0, 0);
    for p in &plans {
        match *p {
            Plan::Requantize(ty) if ty == target => to_target += 1,
            Plan::Requantize(_) => to_fallback += 1,
            Plan::Copy => copied += 1,
        }
    }
    let tensors = |n: usize| if n == 1 { "1 tensor".to_string() } else { format!("{n} tensors") };
    let fallback = if to_fallback > 0 { format!(", {to_fallback} to {FALLBACK}") } else { String::new() };
    outln!(
        "quantized {input_name} -> {} ({target}): {} to {target}{fallback}, {copied} copied; \
         {:.2} MiB -> {:.2} MiB in {:.1} s",
        args.output.display(),
        tensors(to_target),
        mib(model.bytes().len() as u64),
        mib(out_bytes),
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}

/// Writes the whole output to `out`'s temporary file and checks it parses back with the planned
/// tensors; returns its size in bytes.
fn write_output(
    out: &mut OutputFile,
    gguf: &Gguf<'_>,
    tensors: &[TensorInfo<'_>],
    plans: &[Plan],
    headers: &[TensorHeader<'_>],
    metadata: &[(&str, Value<'_>)],
    threads: usize,
) -> Result<u64, CliError> {
    write_gguf(out, metadata, headers, |i| {
        let (t, src) = (&tensors[i], gguf.tensor_data(&tensors[i]));
        match plans[i] {
            Plan::Copy => Ok(Cow::Borrowed(src)),
            Plan::Requantize(ty) => requantize(src, t.ty, ty, t.ne[0] as usize, threads)
                .map(Cow::Owned)
                .map_err(|e| CliError::new(format!("{}: {e}", t.name))),
        }
    })
}

/// Writes a GGUF of `metadata` and tensors `headers` to `out`'s temporary file, tensor `i`'s bytes
/// from `data(i)` (a Ctrl-C stops between tensors), and checks that it parses back with those
/// tensors; returns its size in bytes.
pub(crate) fn write_gguf<'d>(
    out: &mut OutputFile,
    metadata: &[(&str, Value<'_>)],
    headers: &[TensorHeader<'_>],
    mut data: impl FnMut(usize) -> Result<Cow<'d, [u8]>, CliError>,
) -> Result<u64, CliError> {
    let path = out.tmp_path().to_path_buf();
    let io_err = |e: std::io::Error| CliError::new(format!("writing {}: {e}", out.target().display()));
    let file = out.try_clone_file()?;
    let mut writer =
        GgufWriter::start(BufWriter::with_capacity(1 << 20, file), metadata, headers).map_err(io_err)?;
    for i in 0..headers.len() {
        crate::signals::check_interrupt()?;
        writer.write_tensor_data(&data(i)?).map_err(io_err)?;
    }
    let (buf, len) = writer.finish().map_err(io_err)?;
    buf.into_inner().map_err(|e| io_err(e.into_error()))?.sync_all().map_err(io_err)?;

    let written = ModelFile::open(&path)?;
    let check = written.parse()?;
    let ok = check.tensor_count() == headers.len()
        && check.tensors().zip(headers).all(|(t, h)| t.name == h.name && t.ty == h.ty && t.ne == h.ne);
    if !ok {
        return Err(CliError::new(format!(
            "{}: the written file does not read back as planned",
            path.display()
        )));
    }
    Ok(len)
}
