//! llama.cpp's logits file (`llama-perplexity --kl-divergence-base FILE`) and the statistics of
//! `--kl-divergence`, so pinfer's quality can be compared with llama.cpp's numbers on the same
//! tokens: a file written by either tool is read by both.
//!
//! The file, all little-endian: `_logits_`, n_ctx, n_vocab, n_chunk (i32 each), the n_chunk·n_ctx
//! token ids (i32), then for every chunk and every scored position (n_ctx/2 .. n_ctx-2) one row
//! of `nv = 2·⌈n_vocab/2⌉ + 4` u16: `scale` and `min_log_prob` (f32 each), then one u16 per token,
//! `log p = scale·q + min_log_prob`, 16 nats below the row's best at most (lower ones are q = 0).

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use pinfer::output_file::OutputFile;

use crate::CliError;

const MAGIC: &[u8; 8] = b"_logits_";

/// u16 per row for `n_vocab` tokens (two f32 first; the tokens padded to an even count).
fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// The positions of a chunk that are scored.
pub fn scored_rows(n_ctx: usize) -> usize {
    n_ctx - 1 - n_ctx / 2
}

/// max, first argmax and ln Σ exp(l - max) of a row, as llama.cpp computes them (f32 exps summed
/// in f64, the logarithm rounded to f32).
fn log_sum_exp(logits: &[f32]) -> (f32, usize, f32) {
    let (mut max, mut imax) = (logits[0], 0);
    for (i, &l) in logits.iter().enumerate() {
        if l > max {
            (max, imax) = (l, i);
        }
    }
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    (max, imax, sum.ln() as f32)
}

/// Quantizes one row of logits into `row` (llama.cpp's format); returns the NLL of `target`.
fn quantize_row(logits: &[f32], target: usize, row: &mut [u16]) -> f64 {
    let max = logits.iter().fold(logits[0], |m, &l| m.max(l));
    let min = logits.iter().fold(logits[0], |m, &l| m.min(l)).max(max - 16.0);
    let (_, _, lse) = log_sum_exp(logits);
    let min_log_prob = min - max - lse;
    let scale = (max - min) / 65535.0;
    let (head, q) = row.split_at_mut(4);
    for (pair, v) in head.chunks_exact_mut(2).zip([scale, min_log_prob]) {
        let b = v.to_le_bytes();
        pair[0] = u16::from_le_bytes([b[0], b[1]]);
        pair[1] = u16::from_le_bytes([b[2], b[3]]);
    }
    q.fill(0);
    if scale != 0.0 {
        let inv = 1.0 / scale;
        for (q, &l) in q.iter_mut().zip(logits) {
            if l > min {
                // Round half to even, as ggml's nearest_int; the value lies in 0..=65535.
                *q = (inv * (l - min)).round_ties_even().clamp(0.0, 65535.0) as u16;
            }
        }
    }
    f64::from(max + lse - logits[target])
}

/// Writes a logits file as pinfer scores each chunk.
pub struct Writer {
    file: OutputFile,
    out: BufWriter<std::fs::File>,
    row: Vec<u16>,
    bytes: Vec<u8>,
}

impl Writer {
    /// Starts `path` (through [`OutputFile`]: never over `inputs`) with the header and the ids of
    /// the `n_chunk` chunks of `n_ctx` tokens (`tokens` as tokenized, BOS replacement not applied).
    pub fn create(
        path: &Path,
        inputs: &[&Path],
        n_ctx: usize,
        n_vocab: usize,
        tokens: &[u32],
    ) -> Result<Self, CliError> {
        let n_chunk = tokens.len() / n_ctx;
        let file = OutputFile::create(path, inputs)?;
        let mut out = BufWriter::with_capacity(1 << 20, file.try_clone_file()?);
        let err = |e: std::io::Error| CliError::new(format!("writing {}: {e}", path.display()));
        out.write_all(MAGIC).map_err(err)?;
        for v in [n_ctx, n_vocab, n_chunk] {
            out.write_all(&(v as i32).to_le_bytes()).map_err(err)?;
        }
        for &t in tokens {
            out.write_all(&(t as i32).to_le_bytes()).map_err(err)?;
        }
        let nv = row_len(n_vocab);
        Ok(Self { file, out, row: vec![0; nv], bytes: vec![0; 2 * nv] })
    }

    /// Appends the row of one scored position; returns the NLL of `target` (llama.cpp's
    /// arithmetic in this mode).
    pub fn row(&mut self, logits: &[f32], target: usize) -> Result<f64, CliError> {
        let nll = quantize_row(logits, target, &mut self.row);
        for (b, q) in self.bytes.chunks_exact_mut(2).zip(&self.row) {
            b.copy_from_slice(&q.to_le_bytes());
        }
        let target_path = self.file.target().display().to_string();
        self.out.write_all(&self.bytes).map_err(|e| CliError::new(format!("writing {target_path}: {e}")))?;
        Ok(nll)
    }

    /// Flushes and puts the file in place.
    pub fn commit(self) -> Result<(), CliError> {
        let name = self.file.target().display().to_string();
        self.out.into_inner().map_err(|e| CliError::new(format!("writing {name}: {}", e.error())))?;
        self.file.commit()?;
        Ok(())
    }
}

/// A logits file being read: its header and tokens, then its rows chunk by chunk.
pub struct Reader {
    input: BufReader<std::fs::File>,
    pub n_ctx: usize,
    pub n_chunk: usize,
    pub tokens: Vec<u32>,
    nv: usize,
    bytes: Vec<u8>,
    name: String,
}

impl Reader {
    /// Opens `path` and checks its header against a model of `n_vocab` tokens and its size.
    pub fn open(path: &Path, n_vocab: usize) -> Result<Self, CliError> {
        let name = path.display().to_string();
        let bad = |what: String| {
            CliError::new(format!("{name}: {what}: not a llama.cpp logits file pinfer can use"))
        };
        pinfer::output_file::check_input(path)?;
        let file = std::fs::File::open(path).map_err(|e| CliError::new(format!("{name}: {e}")))?;
        let len = file.metadata().map_err(|e| CliError::new(format!("{name}: {e}")))?.len();
        let mut input = BufReader::with_capacity(1 << 20, file);
        let mut head = [0u8; 20];
        input.read_exact(&mut head).map_err(|_| bad("shorter than its header".into()))?;
        if &head[..8] != MAGIC {
            return Err(bad("no _logits_ magic".into()));
        }
        let field = |at: usize| i32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        let (n_ctx, vocab, n_chunk) = (field(8), field(12), field(16));
        if !(4..=1 << 20).contains(&n_ctx) || n_chunk < 1 {
            return Err(bad(format!("n_ctx {n_ctx}, {n_chunk} chunks")));
        }
        if vocab as usize != n_vocab {
            return Err(CliError::new(format!(
                "{name}: logits of a {vocab}-token vocabulary; this model has {n_vocab}: compare models that share a vocabulary"
            )));
        }
        let (n_ctx, n_chunk) = (n_ctx as usize, n_chunk as usize);
        let nv = row_len(n_vocab);
        let expected = (n_chunk as u64)
            .checked_mul(n_ctx as u64 * 4 + scored_rows(n_ctx) as u64 * nv as u64 * 2)
            .and_then(|b| b.checked_add(20));
        if expected != Some(len) {
            return Err(bad(format!(
                "{len} bytes where the header implies {}",
                expected.unwrap_or(u64::MAX)
            )));
        }
        let mut ids = vec![0u8; n_chunk * n_ctx * 4];
        input.read_exact(&mut ids).map_err(|e| CliError::new(format!("{name}: {e}")))?;
        let tokens: Vec<u32> =
            ids.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect();
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(bad(format!("token id {} outside the vocabulary", *t as i32)));
        }
        Ok(Self { input, n_ctx, n_chunk, tokens, nv, bytes: vec![0; 2 * nv], name })
    }

    /// The next row: (scale, min_log_prob, quantized log-probabilities as little-endian u16 bytes).
    fn next_row(&mut self) -> Result<(f32, f32, &[u8]), CliError> {
        let name = &self.name;
        self.input.read_exact(&mut self.bytes).map_err(|e| CliError::new(format!("{name}: {e}")))?;
        let f = |at: usize| {
            f32::from_le_bytes([self.bytes[at], self.bytes[at + 1], self.bytes[at + 2], self.bytes[at + 3]])
        };
        let (scale, min_log_prob) = (f(0), f(4));
        if !(scale.is_finite() && min_log_prob.is_finite()) {
            return Err(CliError::new(format!("{name}: a row with a non-finite scale: the file is damaged")));
        }
        Ok((scale, min_log_prob, &self.bytes[8..8 + 2 * (self.nv - 4)]))
    }
}

/// The running sums of `--kl-divergence` (llama.cpp's `kl_divergence`).
#[derive(Default)]
pub struct KlStats {
    nll: f64,
    nll2: f64,
    nll_base: f64,
    nll_base2: f64,
    nll_nll_base: f64,
    kld: f64,
    kld2: f64,
    p_diff: f64,
    p_diff2: f64,
    p_diff4: f64,
    same_top: usize,
    count: usize,
    kld_values: Vec<f32>,
    p_diff_values: Vec<f32>,
}

/// Mean and its uncertainty, as llama.cpp's `mean_and_uncertainty`.
fn mean_unc(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    let n = count as f64;
    let f = sum / n;
    let df = sum2 / n - f * f;
    (f, if df > 0.0 && count > 10 { (df / (n - 1.0)).sqrt() } else { 0.0 })
}

/// Linear interpolation between sorted values, as llama.cpp's percentile.
fn percentile(values: &[f32], fraction: f32) -> f32 {
    if fraction <= 0.0 {
        return values[0];
    }
    if fraction >= 1.0 {
        return values[values.len() - 1];
    }
    let p = fraction * (values.len() - 1) as f32;
    let ip = p as usize;
    let p = p - ip as f32;
    (1.0 - p) * values[ip] + p * values[(ip + 1).min(values.len() - 1)]
}

impl KlStats {
    /// Scores one position: the current model's `logits`, the base row of `reader`, the true
    /// next token `target`.
    pub fn add(&mut self, logits: &[f32], reader: &mut Reader, target: usize) -> Result<(), CliError> {
        let (scale, min_log_prob, q) = reader.next_row()?;
        let base = |i: usize| scale * f32::from(u16::from_le_bytes([q[2 * i], q[2 * i + 1]])) + min_log_prob;
        let (max, imax, lse) = log_sum_exp(logits);
        let nll = max + lse - logits[target];
        let nll_base = -base(target);
        let (nll, nll_base) = (f64::from(nll), f64::from(nll_base));
        self.nll += nll;
        self.nll2 += nll * nll;
        self.nll_base += nll_base;
        self.nll_base2 += nll_base * nll_base;
        self.nll_nll_base += nll * nll_base;
        let norm = max + lse;
        let (mut kld, mut best, mut imax_base) = (0f64, f32::NEG_INFINITY, 0);
        for (i, &l) in logits.iter().enumerate() {
            let lb = base(i);
            if i == 0 || lb > best {
                (best, imax_base) = (lb, i);
            }
            if lb > -16.0 {
                kld += f64::from(lb.exp() * (lb - l + norm));
            }
        }
        self.kld += kld;
        self.kld2 += kld * kld;
        self.same_top += usize::from(imax == imax_base);
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.p_diff += p_diff;
        self.p_diff2 += p_diff * p_diff;
        self.p_diff4 += p_diff.powi(4);
        self.count += 1;
        self.kld_values.push(kld as f32);
        self.p_diff_values.push(p_diff as f32);
        Ok(())
    }

    fn ppl(&self) -> (f64, f64) {
        let (m, u) = mean_unc(self.nll, self.nll2, self.count);
        (m.exp(), m.exp() * u)
    }

    fn same_top(&self) -> (f64, f64) {
        let p = self.same_top as f64 / self.count as f64;
        (p, (p * (1.0 - p) / (self.count as f64 - 1.0).max(1.0)).sqrt())
    }

    /// llama.cpp's line after each chunk (cumulative).
    pub fn chunk_line(&self, chunk: usize) -> String {
        let (ppl, ppl_unc) = self.ppl();
        let (m, u) = mean_unc(self.nll, self.nll2, self.count);
        let (mb, ub) = mean_unc(self.nll_base, self.nll_base2, self.count);
        let cov = self.covariance();
        let (kld, kld_unc) = mean_unc(self.kld, self.kld2, self.count);
        let (rms, rms_unc) = self.rms_p_diff();
        let (same, same_unc) = self.same_top();
        let ratio_unc = (u * u + ub * ub - 2.0 * cov).max(0.0).sqrt();
        format!(
            "{chunk:4} {ppl:16.4} ± {ppl_unc:10.4} {:14.5} ± {ratio_unc:10.5} {kld:14.5} ± {kld_unc:10.5} \
             {:9.3} ± {:5.3} % {:9.3} ± {:5.3} %",
            m - mb,
            100.0 * rms,
            100.0 * rms_unc,
            100.0 * same,
            100.0 * same_unc
        )
    }

    /// RMS of Δp and its uncertainty.
    fn rms_p_diff(&self) -> (f64, f64) {
        let (ms, ums) = mean_unc(self.p_diff2, self.p_diff4, self.count);
        let rms = ms.sqrt();
        (rms, if rms > 0.0 { 0.5 / rms * ums } else { 0.0 })
    }

    fn covariance(&self) -> f64 {
        let n = self.count as f64;
        if self.count < 10 {
            return 0.0;
        }
        (self.nll_nll_base / n - (self.nll / n) * (self.nll_base / n)) / (n - 1.0)
    }

    /// The summary llama.cpp prints (only from 100 scored positions on, as llama.cpp).
    pub fn summary(mut self) -> String {
        let mut s = String::new();
        let w = &mut s;
        use std::fmt::Write as _;
        if self.count < 100 {
            let _ = writeln!(w, "({} scored positions: the summary needs 100, as llama.cpp's)", self.count);
            return s;
        }
        self.kld_values.sort_by(f32::total_cmp);
        self.p_diff_values.sort_by(f32::total_cmp);
        let (m, u) = mean_unc(self.nll, self.nll2, self.count);
        let (mb, ub) = mean_unc(self.nll_base, self.nll_base2, self.count);
        let cov = self.covariance();
        let (ppl, ppl_unc) = (m.exp(), m.exp() * u);
        let (ppl_b, ppl_b_unc) = (mb.exp(), mb.exp() * ub);
        let _ = writeln!(w, "====== Perplexity statistics ======");
        let _ = writeln!(w, "Mean PPL(Q)                   : {ppl:10.6} ± {ppl_unc:10.6}");
        let _ = writeln!(w, "Mean PPL(base)                : {ppl_b:10.6} ± {ppl_b_unc:10.6}");
        let cor = if u > 0.0 && ub > 0.0 { cov / (u * ub) } else { 0.0 };
        let _ = writeln!(w, "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%", 100.0 * cor);
        let log_ratio = m - mb;
        let log_ratio_unc = (u * u + ub * ub - 2.0 * cov).max(0.0).sqrt();
        let _ = writeln!(w, "Mean ln(PPL(Q)/PPL(base))     : {log_ratio:10.6} ± {log_ratio_unc:10.6}");
        let ratio = log_ratio.exp();
        let _ = writeln!(w, "Mean PPL(Q)/PPL(base)         : {ratio:10.6} ± {:10.6}", ratio * log_ratio_unc);
        let diff_unc = (ppl_unc * ppl_unc + ppl_b_unc * ppl_b_unc - 2.0 * ppl * ppl_b * cov).max(0.0).sqrt();
        let _ = writeln!(w, "Mean PPL(Q)-PPL(base)         : {:10.6} ± {diff_unc:10.6}", ppl - ppl_b);
        let _ = writeln!(w);
        let (kld, kld_unc) = mean_unc(self.kld, self.kld2, self.count);
        let k = &self.kld_values;
        let _ = writeln!(w, "====== KL divergence statistics ======");
        let _ = writeln!(w, "Mean    KLD: {kld:10.6} ± {kld_unc:10.6}");
        let _ = writeln!(w, "Maximum KLD: {:10.6}", k[k.len() - 1]);
        for (label, f) in [("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90)] {
            let _ = writeln!(w, "{label}   KLD: {:10.6}", percentile(k, f));
        }
        let _ = writeln!(w, "Median  KLD: {:10.6}", median(k));
        for (label, f) in [("10.0%", 0.10), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)] {
            let _ = writeln!(w, "{label}   KLD: {:10.6}", percentile(k, f));
        }
        let _ = writeln!(w, "Minimum KLD: {:10.6}", k[0]);
        let _ = writeln!(w);
        let p = &self.p_diff_values;
        let (pd, pd_unc) = mean_unc(self.p_diff, self.p_diff2, self.count);
        let _ = writeln!(w, "====== Token probability statistics ======");
        let _ = writeln!(w, "Mean    Δp: {:6.3} ± {:5.3} %", 100.0 * pd, 100.0 * pd_unc);
        let _ = writeln!(w, "Maximum Δp: {:6.3}%", 100.0 * p[p.len() - 1]);
        for (label, f) in
            [("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.90), ("75.0%", 0.75)]
        {
            let _ = writeln!(w, "{label}   Δp: {:6.3}%", 100.0 * percentile(p, f));
        }
        let _ = writeln!(w, "Median  Δp: {:6.3}%", 100.0 * median(p));
        for (label, f) in
            [("25.0%", 0.25), ("10.0%", 0.10), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)]
        {
            let _ = writeln!(w, "{label}   Δp: {:6.3}%", 100.0 * percentile(p, f));
        }
        let _ = writeln!(w, "Minimum Δp: {:6.3}%", 100.0 * p[0]);
        let (rms, rms_unc) = self.rms_p_diff();
        let _ = writeln!(w, "RMS Δp    : {:6.3} ± {:5.3} %", 100.0 * rms, 100.0 * rms_unc);
        let (same, same_unc) = self.same_top();
        let _ = writeln!(w, "Same top p: {:6.3} ± {:5.3} %", 100.0 * same, 100.0 * same_unc);
        s
    }
}

/// The middle value (the mean of the two middle ones for an even count), as llama.cpp.
fn median(sorted: &[f32]) -> f32 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
    }
}
