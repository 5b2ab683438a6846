//! Packed matmuls (with and without `sdot`) and the activation quantization they read.

use core::arch::aarch64::*;
use core::arch::asm;
use core::ops::Range;

use super::*;
use crate::kernels::packed::{
    quantize_act_ref, ActBlock, PackedFormat, PackedMatrix, BLOCK, GROUP_ROWS, Q4K_SCALE_BYTES, SUPER_BLOCKS,
    SUPER_SCALE_BYTES,
};
use crate::kernels::widen::{q4k_lengths_match, Q4K_WIDE_UNIT};

// ---------------------------------------------------------------------------------------------
// Shared matmul plumbing

/// Checks everything the kernels rely on to stay inside the buffers (they read through raw
/// pointers); returns the token count, or `None` when there is nothing to compute.
fn matmul_tokens(
    w: &PackedMatrix<'_>,
    groups: &Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) -> Option<usize> {
    assert!(w.is_consistent() && groups.start <= groups.end && groups.end <= w.groups(), "bad matmul shape");
    let (n, nb, rows) = (acts.len().min(outs.len()), w.blocks(), GROUP_ROWS * groups.len());
    for (a, o) in acts.iter().zip(outs.iter()) {
        assert!(a.len() >= nb && o.len() >= rows, "activation or output row too short");
    }
    if nb == 0 {
        outs.iter_mut().take(n).for_each(|o| o[..rows].fill(0.0));
        return None;
    }
    (n > 0 && rows > 0).then_some(n)
}

/// 64 zero bytes: one `ld1` of them clears up to four vector registers.
static ZEROS: [f32; 16] = [0.0; 16];

// ---------------------------------------------------------------------------------------------
// Packed matmul with `sdot`
//
// Each kernel call walks a run of row groups for 1 to 16 tokens; the group loop and the block
// loop are inside one `asm!` block. Three kernel shapes:
//
// * Wide tiles (16 tokens, prompts): see below at `wide_kernel`.
// * Tiles (2 to 4 tokens, and the tails): 2 groups (8 rows) per pass. Per block the weights of both groups are
//   loaded (4-bit ones unpacked) once into v0-v15 and reused by every token: 16 `sdot`s per token
//   into v28/v29 (zeroed by one load), then converted and scaled into the float accumulators.
//     v0-v7, v8-v15  group 0/1 weights, 8 vectors of 4 rows x 4 elements: v0-v3 (v8-v11) elements
//                    0..16, v4-v7 (v12-v15) elements 16..32 (4-bit: low/high nibbles, x16)
//     v16-v23        accumulators, token t in v(16+2t) (group 0) and v(17+2t) (group 1); formats
//                    with a second scale keep it in v22/v23 (so at most 3 tokens)
//     v24            0xF0 nibble mask (4-bit formats)
//     v25            lanes 2, 3: the token's activation d and s
//     v26, v27       the token's 32 activation quants
//     v28, v29       integer block dots
//     v30, v31       group 0/1 row scales d (f32)
// * Single token (decode): 4 groups (16 rows) per pass, sharing one activation load per block;
//   group g's dots go to v(20+g), its accumulator is v(16+g). After block 0 the blocks go in
//   pairs (Q4/Q8 load both blocks' row scales at once).
//
// Activations: one `ld1` of 48 bytes from 8 bytes before a block gets the previous block's tail,
// then d, s and the 32 quants: one load per token and block. Block 0 (where those 8 bytes may lie
// outside the row) is peeled and loaded in three instructions.

/// One kernel call: `units` passes (of 2 groups, or 4 for the single-token kernels) over
/// consecutive row groups starting at `wq`/`ws` (group strides `gq`/`gs` bytes: a stride of 0 runs
/// one group twice, for an odd tail), up to four tokens (activation rows `a`, outputs `o`: 4
/// floats per group and pass), `nb` blocks; `back` = the bytes an activation pointer advances per
/// pass (`40 nb - 8`).
struct Job {
    wq: *const u8,
    gq: usize,
    ws: *const u8,
    gs: usize,
    units: usize,
    nb: usize,
    back: usize,
    a: [*const ActBlock; 4],
    o: [*mut f32; 4],
}

type DotKernel = unsafe fn(&Job);

/// `{name}`: an asm operand reference for a macro-supplied operand name.
macro_rules! op {
    ($a:ident) => {
        concat!("{", stringify!($a), "}")
    };
}

#[rustfmt::skip]
macro_rules! act_load {
    (first, $a:ident) => { concat!(
        "ld1 {{v25.d}}[1], [", op!($a), "], #8\n",
        "ld1 {{v26.16b, v27.16b}}, [", op!($a), "], #32\n",
        "sub ", op!($a), ", ", op!($a), ", #8\n",
    ) };
    (steady, $a:ident) => { concat!(
        "ld1 {{v25.16b, v26.16b, v27.16b}}, [", op!($a), "], {c40}\n",
    ) };
}

/// 4 `sdot`s into `v$s` of weight vectors `v$w0..` with the 4 quant groups of `v$a`.
#[rustfmt::skip]
macro_rules! sdot4 { ($s:literal, $a:literal, $w0:literal, $w1:literal, $w2:literal, $w3:literal) => { concat!(
    "sdot v", $s, ".4s, v", $w0, ".16b, v", $a, ".4b[0]\n",
    "sdot v", $s, ".4s, v", $w1, ".16b, v", $a, ".4b[1]\n",
    "sdot v", $s, ".4s, v", $w2, ".16b, v", $a, ".4b[2]\n",
    "sdot v", $s, ".4s, v", $w3, ".16b, v", $a, ".4b[3]\n",
) } }

/// 4-bit unpack: low nibbles x16 in place (`v$w*`), high nibbles x16 into `v$h*`.
#[rustfmt::skip]
macro_rules! unpack4 { ($w0:literal, $w1:literal, $w2:literal, $w3:literal,
                        $h0:literal, $h1:literal, $h2:literal, $h3:literal) => { concat!(
    "and v", $h0, ".16b, v", $w0, ".16b, v24.16b\n",  "and v", $h1, ".16b, v", $w1, ".16b, v24.16b\n",
    "and v", $h2, ".16b, v", $w2, ".16b, v24.16b\n",  "and v", $h3, ".16b, v", $w3, ".16b, v24.16b\n",
    "shl v", $w0, ".16b, v", $w0, ".16b, #4\n",       "shl v", $w1, ".16b, v", $w1, ".16b, #4\n",
    "shl v", $w2, ".16b, v", $w2, ".16b, #4\n",       "shl v", $w3, ".16b, v", $w3, ".16b, #4\n",
) } }

/// Loads one group's block into `v$w0..v$w3` (64 bytes) from `$wq`.
#[rustfmt::skip]
macro_rules! ld4 { ($wq:ident, $w0:literal, $w1:literal, $w2:literal, $w3:literal) => { concat!(
    "ld1 {{v", $w0, ".16b, v", $w1, ".16b, v", $w2, ".16b, v", $w3, ".16b}}, [", op!($wq), "], #64\n",
) } }

// --- Tiles: 2 groups x up to 4 tokens ---

/// Both groups' block dots for the loaded token, into v28 (group 0) and v29 (group 1).
#[rustfmt::skip]
macro_rules! dots16 { () => { concat!(
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    "sdot v28.4s, v0.16b, v26.4b[0]\n",  "sdot v29.4s, v8.16b, v26.4b[0]\n",
    "sdot v28.4s, v1.16b, v26.4b[1]\n",  "sdot v29.4s, v9.16b, v26.4b[1]\n",
    "sdot v28.4s, v2.16b, v26.4b[2]\n",  "sdot v29.4s, v10.16b, v26.4b[2]\n",
    "sdot v28.4s, v3.16b, v26.4b[3]\n",  "sdot v29.4s, v11.16b, v26.4b[3]\n",
    "sdot v28.4s, v4.16b, v27.4b[0]\n",  "sdot v29.4s, v12.16b, v27.4b[0]\n",
    "sdot v28.4s, v5.16b, v27.4b[1]\n",  "sdot v29.4s, v13.16b, v27.4b[1]\n",
    "sdot v28.4s, v6.16b, v27.4b[2]\n",  "sdot v29.4s, v14.16b, v27.4b[2]\n",
    "sdot v28.4s, v7.16b, v27.4b[3]\n",  "sdot v29.4s, v15.16b, v27.4b[3]\n",
) } }

/// `F += (dot * d_w) * d_a` for both groups; `$cvt` is `", #4"` for 4-bit values (x16).
#[rustfmt::skip]
macro_rules! scale2 { ($f0:ident, $f1:ident, $cvt:literal) => { concat!(
    "scvtf v28.4s, v28.4s", $cvt, "\n",  "scvtf v29.4s, v29.4s", $cvt, "\n",
    "fmul v28.4s, v28.4s, v30.4s\n",     "fmul v29.4s, v29.4s, v31.4s\n",
    "fmla ", stringify!($f0), ".4s, v28.4s, v25.s[2]\n",
    "fmla ", stringify!($f1), ".4s, v29.4s, v25.s[2]\n",
) } }

/// `F += m * s_a` for both groups (mins in v22/v23).
#[rustfmt::skip]
macro_rules! min2 { ($f0:ident, $f1:ident) => { concat!(
    "fmla ", stringify!($f0), ".4s, v22.4s, v25.s[3]\n",
    "fmla ", stringify!($f1), ".4s, v23.4s, v25.s[3]\n",
) } }

#[rustfmt::skip]
macro_rules! tok_q4 { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ", #4"))
} }
#[rustfmt::skip]
macro_rules! tok_q8 { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ""))
} }
#[rustfmt::skip]
macro_rules! tok_q4m { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ", #4"), min2!($f0, $f1))
} }
#[rustfmt::skip]
macro_rules! tok_q8m { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ""), min2!($f0, $f1))
} }

/// Q8Sub16: per group, dots of elements 0..16 (v28) and 16..32 (v29) with their own scales
/// (v30/v31 and v22/v23).
#[rustfmt::skip]
macro_rules! tok_q8s { ($m:ident, $a:ident, $f0:ident, $f1:ident) => { concat!(
    act_load!($m, $a),
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    sdot4!("28", "26", "0", "1", "2", "3"),
    sdot4!("29", "27", "4", "5", "6", "7"),
    "scvtf v28.4s, v28.4s\n",            "scvtf v29.4s, v29.4s\n",
    "fmul v28.4s, v28.4s, v30.4s\n",     "fmla v28.4s, v29.4s, v22.4s\n",
    "fmla ", stringify!($f0), ".4s, v28.4s, v25.s[2]\n",
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    sdot4!("28", "26", "8", "9", "10", "11"),
    sdot4!("29", "27", "12", "13", "14", "15"),
    "scvtf v28.4s, v28.4s\n",            "scvtf v29.4s, v29.4s\n",
    "fmul v28.4s, v28.4s, v31.4s\n",     "fmla v28.4s, v29.4s, v23.4s\n",
    "fmla ", stringify!($f1), ".4s, v28.4s, v25.s[2]\n",
) } }

#[rustfmt::skip]
macro_rules! wload4 { () => { concat!(
    ld4!(wq0, "0", "1", "2", "3"),       ld4!(wq1, "8", "9", "10", "11"),
    unpack4!("0", "1", "2", "3", "4", "5", "6", "7"),
    unpack4!("8", "9", "10", "11", "12", "13", "14", "15"),
) } }
#[rustfmt::skip]
macro_rules! wload8 { () => { concat!(
    ld4!(wq0, "0", "1", "2", "3"),       ld4!(wq0, "4", "5", "6", "7"),
    ld4!(wq1, "8", "9", "10", "11"),     ld4!(wq1, "12", "13", "14", "15"),
) } }
/// Row scales d of both groups (formats with one scale).
#[rustfmt::skip]
macro_rules! scales_d { () => { concat!(
    "ldr d30, [{ws0}], #8\n",            "ldr d31, [{ws1}], #8\n",
    "fcvtl v30.4s, v30.4h\n",            "fcvtl v31.4s, v31.4h\n",
) } }
/// Row scales d (v30/v31) and second scales (v22/v23) of both groups.
#[rustfmt::skip]
macro_rules! scales_dm { () => { concat!(
    "ldr q30, [{ws0}], #16\n",           "ldr q31, [{ws1}], #16\n",
    "fcvtl2 v22.4s, v30.8h\n",           "fcvtl2 v23.4s, v31.8h\n",
    "fcvtl v30.4s, v30.4h\n",            "fcvtl v31.4s, v31.4h\n",
) } }

#[rustfmt::skip]
macro_rules! grp_q4 { () => { concat!(wload4!(), scales_d!()) } }
#[rustfmt::skip]
macro_rules! grp_q8 { () => { concat!(wload8!(), scales_d!()) } }
/// Q4Min: the stored values are `nibble - 8`, so the min becomes `m + 8 d`.
#[rustfmt::skip]
macro_rules! grp_q4m { () => { concat!(
    wload4!(), scales_dm!(),
    "fmov v28.4s, #8.0\n",
    "fmla v22.4s, v30.4s, v28.4s\n",     "fmla v23.4s, v31.4s, v28.4s\n",
) } }
#[rustfmt::skip]
macro_rules! grp_q8m { () => { concat!(wload8!(), scales_dm!()) } }

#[rustfmt::skip]
macro_rules! mask { () => { "movi v24.16b, #0xf0\n" } }
#[rustfmt::skip]
macro_rules! nothing { () => { "" } }
/// Clears the accumulators (v16-v23, or v16-v21 where v22/v23 hold second scales).
#[rustfmt::skip]
macro_rules! zero8 { () => { concat!(
    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]\n",
    "ld1 {{v20.4s, v21.4s, v22.4s, v23.4s}}, [{zp}]\n",
) } }
#[rustfmt::skip]
macro_rules! zero6 { () => { concat!(
    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]\n",
    "ld1 {{v20.4s, v21.4s}}, [{zp}]\n",
) } }

/// Defines a tile kernel: `$init`, `$zero`, `$grp`, `$tok` name the format's pieces; one tuple
/// per token (index, pointer operand names, accumulator registers).
#[rustfmt::skip]
macro_rules! tile_kernel {
    ($name:ident, $init:ident, $zero:ident, $grp:ident, $tok:ident,
     [$( ($i:literal, $a:ident, $o:ident, $f0:ident, $f1:ident) ),+]) => {
        #[target_feature(enable = "dotprod")]
        unsafe fn $name(job: &Job) {
            $( let $a = job.a[$i]; let $o = job.o[$i]; )+
            // SAFETY: by the caller's contract (see `Job`), the weight pointers address `units` pairs of
            // groups of `nb` blocks of quants and scales, each activation pointer `nb` blocks,
            // each output `8 units` writable floats; the CPU has dotprod. Every register written
            // is declared clobbered.
            unsafe {
                asm!(
                    $init!(),
                    "add {wq1}, {wq0}, {gq}",
                    "add {ws1}, {ws0}, {gs}",
                    "4:",
                    $zero!(),
                    "mov {n}, {nb}",
                    $grp!(),
                    $( $tok!(first, $a, $f0, $f1), )+
                    "subs {n}, {n}, #1",
                    "b.eq 3f",
                    "2:",
                    $grp!(),
                    $( $tok!(steady, $a, $f0, $f1), )+
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "3:",
                    $( concat!("st1 {{", stringify!($f0), ".4s, ", stringify!($f1), ".4s}}, [",
                               op!($o), "], #32"),
                       concat!("sub ", op!($a), ", ", op!($a), ", {back}"), )+
                    "mov {wq0}, {wq1}",
                    "add {wq1}, {wq1}, {gq}",
                    "mov {ws0}, {ws1}",
                    "add {ws1}, {ws1}, {gs}",
                    "subs {units}, {units}, #1",
                    "b.ne 4b",
                    wq0 = inout(reg) job.wq => _,
                    wq1 = out(reg) _,
                    ws0 = inout(reg) job.ws => _,
                    ws1 = out(reg) _,
                    gq = in(reg) job.gq,
                    gs = in(reg) job.gs,
                    units = inout(reg) job.units => _,
                    nb = in(reg) job.nb,
                    n = out(reg) _,
                    back = in(reg) job.back,
                    zp = in(reg) ZEROS.as_ptr(),
                    c40 = in(reg) core::mem::size_of::<ActBlock>(),
                    $( $a = inout(reg) $a => _, $o = inout(reg) $o => _, )+
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

/// The tile kernels of one format for 1, 2, 3 (and 4) tokens.
#[rustfmt::skip]
macro_rules! tile_kernels {
    ($init:ident, $zero:ident, $grp:ident, $tok:ident, $k1:ident, $k2:ident, $k3:ident) => {
        tile_kernel!($k1, $init, $zero, $grp, $tok, [(0, a0, o0, v16, v17)]);
        tile_kernel!($k2, $init, $zero, $grp, $tok, [(0, a0, o0, v16, v17), (1, a1, o1, v18, v19)]);
        tile_kernel!($k3, $init, $zero, $grp, $tok,
            [(0, a0, o0, v16, v17), (1, a1, o1, v18, v19), (2, a2, o2, v20, v21)]);
    };
    ($init:ident, $zero:ident, $grp:ident, $tok:ident, $k1:ident, $k2:ident, $k3:ident, $k4:ident) => {
        tile_kernels!($init, $zero, $grp, $tok, $k1, $k2, $k3);
        tile_kernel!($k4, $init, $zero, $grp, $tok,
            [(0, a0, o0, v16, v17), (1, a1, o1, v18, v19), (2, a2, o2, v20, v21), (3, a3, o3, v22, v23)]);
    };
}

tile_kernels!(mask, zero8, grp_q4, tok_q4, q4_t1, q4_t2, q4_t3, q4_t4);
tile_kernels!(nothing, zero8, grp_q8, tok_q8, q8_t1, q8_t2, q8_t3, q8_t4);
tile_kernels!(mask, zero6, grp_q4m, tok_q4m, q4m_t1, q4m_t2, q4m_t3);
tile_kernels!(nothing, zero6, grp_q8m, tok_q8m, q8m_t1, q8m_t2, q8m_t3);
tile_kernels!(nothing, zero6, grp_q8m, tok_q8s, q8s_t1, q8s_t2, q8s_t3);

// --- Single token: 4 groups ---

/// One group's 4-bit block into `v$w0..v$w7` and its 8 dots into `v$s`.
#[rustfmt::skip]
macro_rules! gv_w4 { ($wq:ident, $s:literal, $w0:literal, $w1:literal, $w2:literal, $w3:literal,
                      $w4:literal, $w5:literal, $w6:literal, $w7:literal) => { concat!(
    ld4!($wq, $w0, $w1, $w2, $w3),
    unpack4!($w0, $w1, $w2, $w3, $w4, $w5, $w6, $w7),
    sdot4!($s, "26", $w0, $w1, $w2, $w3),
    sdot4!($s, "27", $w4, $w5, $w6, $w7),
) } }
/// One group's 8-bit block into `v$w0..v$w7` and its 8 dots into `v$s`.
#[rustfmt::skip]
macro_rules! gv_w8 { ($wq:ident, $s:literal, $w0:literal, $w1:literal, $w2:literal, $w3:literal,
                      $w4:literal, $w5:literal, $w6:literal, $w7:literal) => { concat!(
    ld4!($wq, $w0, $w1, $w2, $w3),
    ld4!($wq, $w4, $w5, $w6, $w7),
    sdot4!($s, "26", $w0, $w1, $w2, $w3),
    sdot4!($s, "27", $w4, $w5, $w6, $w7),
) } }
/// Q8Sub16: one group's dots of elements 0..16 into `v$s` and 16..32 into `v$h`.
#[rustfmt::skip]
macro_rules! gv_w8s { ($wq:ident, $s:literal, $h:literal) => { concat!(
    ld4!($wq, "0", "1", "2", "3"),
    ld4!($wq, "4", "5", "6", "7"),
    sdot4!($s, "26", "0", "1", "2", "3"),
    sdot4!($h, "27", "4", "5", "6", "7"),
) } }

/// `F += (dot * d_w) * d_a` for one group (`$cvt` as in `scale2`).
#[rustfmt::skip]
macro_rules! gv_d { ($ws:ident, $s:literal, $f:literal, $cvt:literal) => { concat!(
    "ldr d28, [", op!($ws), "], #8\n",
    "fcvtl v28.4s, v28.4h\n",
    "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
) } }
/// As `gv_d`, plus `F += m * s_a`; Q4Min (`$q4`) takes `m + 8 d` (8.0 in v30).
#[rustfmt::skip]
macro_rules! gv_dm { ($ws:ident, $s:literal, $f:literal, $cvt:literal, $q4:literal) => { concat!(
    "ldr q28, [", op!($ws), "], #16\n",
    "fcvtl2 v29.4s, v28.8h\n",
    "fcvtl v28.4s, v28.4h\n",
    $q4,
    "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
    "fmla v", $f, ".4s, v29.4s, v25.s[3]\n",
) } }
/// Q8Sub16: `F += (dot_lo * d_lo + dot_hi * d_hi) * d_a` for one group.
#[rustfmt::skip]
macro_rules! gv_ds { ($ws:ident, $s:literal, $h:literal, $f:literal) => { concat!(
    "ldr q28, [", op!($ws), "], #16\n",
    "fcvtl2 v29.4s, v28.8h\n",
    "fcvtl v28.4s, v28.4h\n",
    "scvtf v", $s, ".4s, v", $s, ".4s\n",
    "scvtf v", $h, ".4s, v", $h, ".4s\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $s, ".4s, v", $h, ".4s, v29.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
) } }

#[rustfmt::skip]
macro_rules! zero_dots { () => { "ld1 {{v20.4s, v21.4s, v22.4s, v23.4s}}, [{zp}]\n" } }

#[rustfmt::skip]
macro_rules! gv_q4 { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w4!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w4!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_d!(ws0, "20", "16", ", #4"), gv_d!(ws1, "21", "17", ", #4"),
    gv_d!(ws2, "22", "18", ", #4"), gv_d!(ws3, "23", "19", ", #4"),
) } }
#[rustfmt::skip]
macro_rules! gv_q8 { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w8!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w8!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_d!(ws0, "20", "16", ""), gv_d!(ws1, "21", "17", ""),
    gv_d!(ws2, "22", "18", ""), gv_d!(ws3, "23", "19", ""),
) } }
#[rustfmt::skip]
macro_rules! gv_q4m { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w4!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w4!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_dm!(ws0, "20", "16", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
    gv_dm!(ws1, "21", "17", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
    gv_dm!(ws2, "22", "18", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
    gv_dm!(ws3, "23", "19", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
) } }
#[rustfmt::skip]
macro_rules! gv_q8m { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w8!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w8!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_dm!(ws0, "20", "16", "", ""), gv_dm!(ws1, "21", "17", "", ""),
    gv_dm!(ws2, "22", "18", "", ""), gv_dm!(ws3, "23", "19", "", ""),
) } }
#[rustfmt::skip]
macro_rules! gv_q8s { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    "ld1 {{v8.4s, v9.4s, v10.4s, v11.4s}}, [{zp}]\n",
    gv_w8s!(wq0, "20", "8"), gv_w8s!(wq1, "21", "9"),
    gv_w8s!(wq2, "22", "10"), gv_w8s!(wq3, "23", "11"),
    gv_ds!(ws0, "20", "8", "16"), gv_ds!(ws1, "21", "9", "17"),
    gv_ds!(ws2, "22", "10", "18"), gv_ds!(ws3, "23", "11", "19"),
) } }

/// `F += (dot * d_w) * d_a` for one group, its row scales converted by `$cv` into v28.
#[rustfmt::skip]
macro_rules! gv_dx { ($cv:literal, $s:literal, $f:literal, $cvt:literal) => { concat!(
    $cv,
    "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
) } }
/// Two blocks of Q4 (`$w` is `gv_w4`) or Q8 (`gv_w8`): one load of each group's row scales for both
/// blocks (v8-v11), the weights of every group in v0-v7.
#[rustfmt::skip]
macro_rules! gv_pair { ($w:ident, $cvt:literal) => { concat!(
    "ldr q8, [{ws0}], #16\n",           "ldr q9, [{ws1}], #16\n",
    "ldr q10, [{ws2}], #16\n",          "ldr q11, [{ws3}], #16\n",
    act_load!(steady, a0), zero_dots!(),
    $w!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq1, "21", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq3, "23", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_dx!("fcvtl v28.4s, v8.4h\n", "20", "16", $cvt), gv_dx!("fcvtl v28.4s, v9.4h\n", "21", "17", $cvt),
    gv_dx!("fcvtl v28.4s, v10.4h\n", "22", "18", $cvt), gv_dx!("fcvtl v28.4s, v11.4h\n", "23", "19", $cvt),
    act_load!(steady, a0), zero_dots!(),
    $w!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq1, "21", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq3, "23", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_dx!("fcvtl2 v28.4s, v8.8h\n", "20", "16", $cvt), gv_dx!("fcvtl2 v28.4s, v9.8h\n", "21", "17", $cvt),
    gv_dx!("fcvtl2 v28.4s, v10.8h\n", "22", "18", $cvt), gv_dx!("fcvtl2 v28.4s, v11.8h\n", "23", "19", $cvt),
) } }
#[rustfmt::skip]
macro_rules! gv2_q4 { () => { gv_pair!(gv_w4, ", #4") } }
#[rustfmt::skip]
macro_rules! gv2_q8 { () => { gv_pair!(gv_w8, "") } }
#[rustfmt::skip]
macro_rules! gv2_q4m { () => { concat!(gv_q4m!(steady), gv_q4m!(steady)) } }
#[rustfmt::skip]
macro_rules! gv2_q8m { () => { concat!(gv_q8m!(steady), gv_q8m!(steady)) } }
#[rustfmt::skip]
macro_rules! gv2_q8s { () => { concat!(gv_q8s!(steady), gv_q8s!(steady)) } }

#[rustfmt::skip]
macro_rules! mask8 { () => { concat!(mask!(), "fmov v30.4s, #8.0\n") } }

/// Defines a single-token kernel (4 groups per pass) from the format's block body `$body`.
#[rustfmt::skip]
macro_rules! gemv_kernel {
    ($name:ident, $init:ident, $body:ident, $pair:ident) => {
        #[target_feature(enable = "dotprod")]
        unsafe fn $name(job: &Job) {
            // SAFETY: by the caller's contract (see `Job`), the weight pointers address `units` runs of
            // 4 groups of `nb` blocks of quants and scales, the activation pointer `nb` blocks,
            // the output `16 units` writable floats; the CPU has dotprod. Every register written
            // is declared clobbered.
            unsafe {
                asm!(
                    $init!(),
                    "add {wq1}, {wq0}, {gq}",
                    "add {wq2}, {wq1}, {gq}",
                    "add {wq3}, {wq2}, {gq}",
                    "add {ws1}, {ws0}, {gs}",
                    "add {ws2}, {ws1}, {gs}",
                    "add {ws3}, {ws2}, {gs}",
                    "4:",
                    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]",
                    "sub {n}, {nb}, #1",
                    $body!(first),
                    "tbz {n}, #0, 5f",
                    $body!(steady),
                    "sub {n}, {n}, #1",
                    "5:",
                    "cbz {n}, 3f",
                    "2:",
                    $pair!(),
                    "subs {n}, {n}, #2",
                    "b.ne 2b",
                    "3:",
                    "st1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{o0}], #64",
                    "sub {a0}, {a0}, {back}",
                    "mov {wq0}, {wq3}",
                    "add {wq1}, {wq0}, {gq}",
                    "add {wq2}, {wq1}, {gq}",
                    "add {wq3}, {wq2}, {gq}",
                    "mov {ws0}, {ws3}",
                    "add {ws1}, {ws0}, {gs}",
                    "add {ws2}, {ws1}, {gs}",
                    "add {ws3}, {ws2}, {gs}",
                    "subs {units}, {units}, #1",
                    "b.ne 4b",
                    wq0 = inout(reg) job.wq => _,
                    wq1 = out(reg) _,
                    wq2 = out(reg) _,
                    wq3 = out(reg) _,
                    ws0 = inout(reg) job.ws => _,
                    ws1 = out(reg) _,
                    ws2 = out(reg) _,
                    ws3 = out(reg) _,
                    gq = in(reg) job.gq,
                    gs = in(reg) job.gs,
                    units = inout(reg) job.units => _,
                    nb = in(reg) job.nb,
                    n = out(reg) _,
                    back = in(reg) job.back,
                    zp = in(reg) ZEROS.as_ptr(),
                    c40 = in(reg) core::mem::size_of::<ActBlock>(),
                    a0 = inout(reg) job.a[0] => _,
                    o0 = inout(reg) job.o[0] => _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

gemv_kernel!(q4_gemv, mask, gv_q4, gv2_q4);
gemv_kernel!(q8_gemv, nothing, gv_q8, gv2_q8);
gemv_kernel!(q4m_gemv, mask8, gv_q4m, gv2_q4m);
gemv_kernel!(q8m_gemv, nothing, gv_q8m, gv2_q8m);
gemv_kernel!(q8s_gemv, nothing, gv_q8s, gv2_q8s);

// --- Wide tiles: 1 group x 16 tokens ---
//
// For prompts: the group's weights (v0-v7, unpacked once per block) serve 16 tokens, whose
// accumulators fill v16-v31. v8-v10 hold the token's activation block (d in v8.s[2], s in
// v8.s[3]); the integer dots rotate through v11-v13 (Q4), v11-v14 (Q8) or v11-v12 (Q4Min, Q8Min),
// zeroed by one load per 3, 4 or 2 tokens (Q8Sub16: v11/v12 for the two halves, every token).
// Row scales: v14 with the mask in v15 (Q4), v15 (Q8), v13 with the mins or second scales in v14
// (the rest; Q4Min's mask in v15).

/// Activation block of token `$a` into v8-v10 (as `act_load`).
#[rustfmt::skip]
macro_rules! wact_load {
    (first, $a:ident) => { concat!(
        "ld1 {{v8.d}}[1], [", op!($a), "], #8\n",
        "ld1 {{v9.16b, v10.16b}}, [", op!($a), "], #32\n",
        "sub ", op!($a), ", ", op!($a), ", #8\n",
    ) };
    (steady, $a:ident) => { concat!(
        "ld1 {{v8.16b, v9.16b, v10.16b}}, [", op!($a), "], {c40}\n",
    ) };
}

/// One token: `$z` (a zeroing load or nothing), the block's 8 dots into `v$s`, scaled into `v$f`.
#[rustfmt::skip]
macro_rules! wtok {
    ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal, $cvt:literal, $d:literal) => { concat!(
        $z,
        wact_load!($m, $a),
        sdot4!($s, "9", "0", "1", "2", "3"),
        sdot4!($s, "10", "4", "5", "6", "7"),
        "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
        "fmul v", $s, ".4s, v", $s, ".4s, v", $d, ".4s\n",
        "fmla v", $f, ".4s, v", $s, ".4s, v8.s[2]\n",
    ) };
}
#[rustfmt::skip]
macro_rules! wtok_q4 { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => {
    wtok!($m, $a, $f, $s, $z, ", #4", "14")
} }
#[rustfmt::skip]
macro_rules! wtok_q8 { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => {
    wtok!($m, $a, $f, $s, $z, "", "15")
} }
#[rustfmt::skip]
macro_rules! wgrp_q4 { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    "and v4.16b, v0.16b, v15.16b\n",     "and v5.16b, v1.16b, v15.16b\n",
    "and v6.16b, v2.16b, v15.16b\n",     "and v7.16b, v3.16b, v15.16b\n",
    "shl v0.16b, v0.16b, #4\n",          "shl v1.16b, v1.16b, #4\n",
    "shl v2.16b, v2.16b, #4\n",          "shl v3.16b, v3.16b, #4\n",
    "ldr d14, [{ws}], #8\n",
    "fcvtl v14.4s, v14.4h\n",
) } }
#[rustfmt::skip]
macro_rules! wgrp_q8 { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    ld4!(wq, "4", "5", "6", "7"),
    "ldr d15, [{ws}], #8\n",
    "fcvtl v15.4s, v15.4h\n",
) } }
#[rustfmt::skip]
macro_rules! wmask_q4 { () => { "movi v15.16b, #0xf0\n" } }

/// Defines a wide kernel; one tuple per token (index, pointer operand, accumulator, dot register,
/// zeroing load, output slot offset).
#[rustfmt::skip]
macro_rules! wide_kernel {
    ($name:ident, $init:ident, $grp:ident, $tok:ident,
     [$( ($i:literal, $a:ident, $f:literal, $s:literal, $z:literal, $off:literal) ),+]) => {
        /// # Safety
        /// `wq`/`ws` address `units` consecutive groups of `nb = slots[16]` blocks of quants and
        /// scales; `acts` 16 rows of `nb` blocks; `slots[t]` (t < 16) the address of `4 units`
        /// writable floats; `slots[17] = 40 nb - 8`; the CPU has dotprod.
        #[target_feature(enable = "dotprod")]
        unsafe fn $name(wq: *const u8, ws: *const u8, units: usize, acts: &[*const ActBlock; 16], slots: &[usize; 18]) {
            $( let $a = acts[$i]; )+
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    $init!(),
                    "mov {goff}, #0",
                    "4:",
                    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]",
                    "ld1 {{v20.4s, v21.4s, v22.4s, v23.4s}}, [{zp}]",
                    "ld1 {{v24.4s, v25.4s, v26.4s, v27.4s}}, [{zp}]",
                    "ld1 {{v28.4s, v29.4s, v30.4s, v31.4s}}, [{zp}]",
                    "ldr {n}, [{slots}, #128]",
                    $grp!(),
                    $( $tok!(first, $a, $f, $s, $z), )+
                    "subs {n}, {n}, #1",
                    "b.eq 3f",
                    "2:",
                    $grp!(),
                    $( $tok!(steady, $a, $f, $s, $z), )+
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "3:",
                    $( concat!("ldr {tmp}, [{slots}, #", $off, "]"),
                       concat!("str q", $f, ", [{tmp}, {goff}]"), )+
                    "add {goff}, {goff}, #16",
                    "ldr {tmp}, [{slots}, #136]",
                    $( concat!("sub ", op!($a), ", ", op!($a), ", {tmp}"), )+
                    "subs {units}, {units}, #1",
                    "b.ne 4b",
                    wq = inout(reg) wq => _,
                    ws = inout(reg) ws => _,
                    units = inout(reg) units => _,
                    slots = in(reg) slots.as_ptr(),
                    goff = out(reg) _,
                    tmp = out(reg) _,
                    n = out(reg) _,
                    zp = in(reg) ZEROS.as_ptr(),
                    c40 = in(reg) core::mem::size_of::<ActBlock>(),
                    $( $a = inout(reg) $a => _, )+
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

type WideKernel = unsafe fn(*const u8, *const u8, usize, &[*const ActBlock; 16], &[usize; 18]);

#[rustfmt::skip]
wide_kernel!(q4_wide, wmask_q4, wgrp_q4, wtok_q4, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "13", "", "16"),
    (3, a3, "19", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "24"),
    (4, a4, "20", "12", "", "32"),
    (5, a5, "21", "13", "", "40"),
    (6, a6, "22", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "48"),
    (7, a7, "23", "12", "", "56"),
    (8, a8, "24", "13", "", "64"),
    (9, a9, "25", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "72"),
    (10, a10, "26", "12", "", "80"),
    (11, a11, "27", "13", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "13", "", "112"),
    (15, a15, "31", "11", "ld1 {{v11.16b}}, [{zp}]\n", "120")
]);
#[rustfmt::skip]
wide_kernel!(q8_wide, nothing, wgrp_q8, wtok_q8, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "13", "", "16"),
    (3, a3, "19", "14", "", "24"),
    (4, a4, "20", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "32"),
    (5, a5, "21", "12", "", "40"),
    (6, a6, "22", "13", "", "48"),
    (7, a7, "23", "14", "", "56"),
    (8, a8, "24", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "64"),
    (9, a9, "25", "12", "", "72"),
    (10, a10, "26", "13", "", "80"),
    (11, a11, "27", "14", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "13", "", "112"),
    (15, a15, "31", "14", "", "120")
]);

/// Q4Min / Q8Min: as `wtok`, plus `F += m * s_a` (min in v14, row scales in v13).
#[rustfmt::skip]
macro_rules! wtok_q4m { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => { concat!(
    wtok!($m, $a, $f, $s, $z, ", #4", "13"),
    "fmla v", $f, ".4s, v14.4s, v8.s[3]\n",
) } }
#[rustfmt::skip]
macro_rules! wtok_q8m { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => { concat!(
    wtok!($m, $a, $f, $s, $z, "", "13"),
    "fmla v", $f, ".4s, v14.4s, v8.s[3]\n",
) } }
/// Q8Sub16: dots of elements 0..16 into v11 and 16..32 into v12, scales in v13 and v14.
#[rustfmt::skip]
macro_rules! wtok_q8s { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => { concat!(
    "ld1 {{v11.16b, v12.16b}}, [{zp}]\n",
    wact_load!($m, $a),
    sdot4!("11", "9", "0", "1", "2", "3"),
    sdot4!("12", "10", "4", "5", "6", "7"),
    "scvtf v11.4s, v11.4s\n",            "scvtf v12.4s, v12.4s\n",
    "fmul v11.4s, v11.4s, v13.4s\n",     "fmla v11.4s, v12.4s, v14.4s\n",
    "fmla v", $f, ".4s, v11.4s, v8.s[2]\n",
) } }
/// Row scales (v13) and mins or second scales (v14) of one group.
#[rustfmt::skip]
macro_rules! wscales_dm { () => { concat!(
    "ldr q13, [{ws}], #16\n",
    "fcvtl2 v14.4s, v13.8h\n",
    "fcvtl v13.4s, v13.4h\n",
) } }
/// Q4Min: the min becomes `m + 8 d`.
#[rustfmt::skip]
macro_rules! wgrp_q4m { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    "and v4.16b, v0.16b, v15.16b\n",     "and v5.16b, v1.16b, v15.16b\n",
    "and v6.16b, v2.16b, v15.16b\n",     "and v7.16b, v3.16b, v15.16b\n",
    "shl v0.16b, v0.16b, #4\n",          "shl v1.16b, v1.16b, #4\n",
    "shl v2.16b, v2.16b, #4\n",          "shl v3.16b, v3.16b, #4\n",
    wscales_dm!(),
    "fmov v11.4s, #8.0\n",
    "fmla v14.4s, v13.4s, v11.4s\n",
) } }
#[rustfmt::skip]
macro_rules! wgrp_q8m { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    ld4!(wq, "4", "5", "6", "7"),
    wscales_dm!(),
) } }

#[rustfmt::skip]
wide_kernel!(q4m_wide, wmask_q4, wgrp_q4m, wtok_q4m, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "16"),
    (3, a3, "19", "12", "", "24"),
    (4, a4, "20", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "32"),
    (5, a5, "21", "12", "", "40"),
    (6, a6, "22", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "48"),
    (7, a7, "23", "12", "", "56"),
    (8, a8, "24", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "64"),
    (9, a9, "25", "12", "", "72"),
    (10, a10, "26", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "80"),
    (11, a11, "27", "12", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "112"),
    (15, a15, "31", "12", "", "120")
]);
#[rustfmt::skip]
wide_kernel!(q8m_wide, nothing, wgrp_q8m, wtok_q8m, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "16"),
    (3, a3, "19", "12", "", "24"),
    (4, a4, "20", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "32"),
    (5, a5, "21", "12", "", "40"),
    (6, a6, "22", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "48"),
    (7, a7, "23", "12", "", "56"),
    (8, a8, "24", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "64"),
    (9, a9, "25", "12", "", "72"),
    (10, a10, "26", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "80"),
    (11, a11, "27", "12", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "112"),
    (15, a15, "31", "12", "", "120")
]);
#[rustfmt::skip]
wide_kernel!(q8s_wide, nothing, wgrp_q8m, wtok_q8s, [
    (0, a0, "16", "", "", "0"), (1, a1, "17", "", "", "8"),
    (2, a2, "18", "", "", "16"), (3, a3, "19", "", "", "24"),
    (4, a4, "20", "", "", "32"), (5, a5, "21", "", "", "40"),
    (6, a6, "22", "", "", "48"), (7, a7, "23", "", "", "56"),
    (8, a8, "24", "", "", "64"), (9, a9, "25", "", "", "72"),
    (10, a10, "26", "", "", "80"), (11, a11, "27", "", "", "88"),
    (12, a12, "28", "", "", "96"), (13, a13, "29", "", "", "104"),
    (14, a14, "30", "", "", "112"), (15, a15, "31", "", "", "120")
]);

/// Row groups per chunk: a chunk's weights stay in cache while every token tile passes over them.
const CHUNK_GROUPS: usize = 32;

/// Packed matmul with `sdot`: one token runs 16 rows per pass; more run 4 rows x 16 tokens while
/// 16 are left, then tiles of 8 rows x up to 4 tokens (3 for the two-scale formats).
///
/// With `fp16`, Q6K's scales are computed in FEAT_FP16 arithmetic (same values, fewer
/// instructions).
///
/// # Safety
/// The CPU must have FEAT_DotProd, and FEAT_FP16 with `fp16`.
#[target_feature(enable = "dotprod")]
pub unsafe fn matmul_dotprod(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    fp16: bool,
) {
    if matches!(w.format, PackedFormat::Q4K | PackedFormat::Q5K) {
        use crate::kernels::KernelPath::{NeonDotprod, NeonFp16};
        return crate::kernels::widen::matmul_decoded(
            if fp16 { NeonFp16 } else { NeonDotprod },
            w,
            groups,
            acts,
            outs,
        );
    }
    if matches!(w.format, PackedFormat::Q5 | PackedFormat::Q5Min) {
        if acts.len().min(outs.len()) == 1 {
            let kernel: Gemv4 = if w.format == PackedFormat::Q5Min { q5m_gemv4 } else { q5_gemv4 };
            // SAFETY: the CPU has dotprod (this function's contract); the Q5 passes loop over blocks.
            return unsafe { gemv_passes(w, groups, acts, outs, kernel, w.blocks()) };
        }
        let path = crate::kernels::KernelPath::NeonDotprod;
        return crate::kernels::widen::matmul_widened(path, w, groups, acts, outs);
    }
    if w.format == PackedFormat::Q6K {
        if acts.len().min(outs.len()) == 1 {
            let kernel: Gemv4 = if fp16 { q6k_gemv4_fp16 } else { q6k_gemv4 };
            // SAFETY: the CPU has dotprod, and FEAT_FP16 with `fp16` (this function's contract);
            // the Q6K pass loops over super-blocks.
            return unsafe { gemv_passes(w, groups, acts, outs, kernel, w.blocks() / SUPER_BLOCKS) };
        }
        let path = crate::kernels::KernelPath::NeonDotprod;
        return crate::kernels::widen::matmul_widened(path, w, groups, acts, outs);
    }
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    let (gemv, tiles): (DotKernel, &[DotKernel]) = match w.format {
        PackedFormat::Q4 => (q4_gemv, &[q4_t1, q4_t2, q4_t3, q4_t4]),
        // (Q5 went through `gemv_passes` or `matmul_widened`, which calls back with Q8.)
        PackedFormat::Q8 | PackedFormat::Q5 => (q8_gemv, &[q8_t1, q8_t2, q8_t3, q8_t4]),
        // (Q4K went through `matmul_decoded`, which calls back with Q4Min.)
        PackedFormat::Q4Min | PackedFormat::Q4K => (q4m_gemv, &[q4m_t1, q4m_t2, q4m_t3]),
        PackedFormat::Q8Min | PackedFormat::Q5Min | PackedFormat::Q5K => {
            (q8m_gemv, &[q8m_t1, q8m_t2, q8m_t3])
        }
        PackedFormat::Q8Sub16 | PackedFormat::Q6K => (q8s_gemv, &[q8s_t1, q8s_t2, q8s_t3]),
    };
    let wide: WideKernel = match w.format {
        PackedFormat::Q4 => q4_wide,
        PackedFormat::Q8 | PackedFormat::Q5 => q8_wide,
        PackedFormat::Q4Min | PackedFormat::Q4K => q4m_wide,
        PackedFormat::Q8Min | PackedFormat::Q5Min | PackedFormat::Q5K => q8m_wide,
        PackedFormat::Q8Sub16 | PackedFormat::Q6K => q8s_wide,
    };
    let nb = w.blocks();
    let (gq, gs) = (nb * w.format.quant_bytes(), nb * w.format.scale_bytes());
    // What an activation pointer advances per pass (see `act_load`).
    let back = nb * core::mem::size_of::<ActBlock>() - 8;
    let mut slots = [0usize; 18];
    (slots[16], slots[17]) = (nb, back);
    let mut spare = [[0f32; 2 * GROUP_ROWS]; 4];
    let mut g = groups.start;
    while g < groups.end {
        let left = groups.end - g;
        // Single token: runs of 4 groups; else (and for the rest) pairs; an odd last group runs
        // as a pair with itself, its copy's outputs going to `spare`.
        let quads = n == 1 && left >= 4;
        let count = if quads { left - left % 4 } else { (left - left % 2).max(1) };
        // Chunks only pay when several token tiles pass over the weights.
        let count = if n > 4 { count.min(CHUNK_GROUPS) } else { count };
        let single = count == 1;
        let gi = g - groups.start;
        let mut t = 0;
        // Whole groups of 16 tokens, over the whole run of groups.
        while n - t >= 16 {
            let a: [*const ActBlock; 16] = core::array::from_fn(|i| acts[t + i].as_ptr());
            for (s, o) in slots.iter_mut().zip(&mut outs[t..t + 16]) {
                *s = o[GROUP_ROWS * gi..GROUP_ROWS * (gi + count)].as_mut_ptr() as usize;
            }
            // SAFETY: `matmul_tokens` checked the planes (`count` groups of `nb` blocks from
            // `g`), the activation rows (>= nb blocks) and the output rows (the `4 count`
            // floats at `4 gi` exist); the CPU has dotprod (this function's contract).
            unsafe { wide(w.quants[g * gq..].as_ptr(), w.scales[g * gs..].as_ptr(), count, &a, &slots) };
            t += 16;
        }
        while t < n {
            let (kernel, tn) = if quads {
                (gemv, 1)
            } else {
                let tn = (n - t).min(tiles.len());
                (tiles[tn - 1], tn)
            };
            let mut job = Job {
                wq: w.quants[g * gq..].as_ptr(),
                gq: if single { 0 } else { gq },
                ws: w.scales[g * gs..].as_ptr(),
                gs: if single { 0 } else { gs },
                units: if quads { count / 4 } else { count.div_ceil(2) },
                nb,
                back,
                a: [core::ptr::null(); 4],
                o: [core::ptr::null_mut(); 4],
            };
            for (i, s) in spare.iter_mut().enumerate().take(tn) {
                job.a[i] = acts[t + i].as_ptr();
                job.o[i] = if single {
                    s.as_mut_ptr()
                } else {
                    outs[t + i][GROUP_ROWS * gi..GROUP_ROWS * (gi + count)].as_mut_ptr()
                };
            }
            // SAFETY: `matmul_tokens` checked the planes (consistent, groups in range: `count`
            // groups of `nb` blocks from `g`) and every activation (>= nb blocks) and output row
            // (the `4 count` floats at `4 gi` exist; `spare` takes the 8 of a doubled group); the
            // CPU has dotprod (this function's contract).
            unsafe { kernel(&job) };
            if single {
                for (i, s) in spare.iter().enumerate().take(tn) {
                    outs[t + i][GROUP_ROWS * gi..GROUP_ROWS * (gi + 1)].copy_from_slice(&s[..GROUP_ROWS]);
                }
            }
            t += tn;
        }
        g += count;
    }
}

// ---------------------------------------------------------------------------------------------
// Q6K, one token: unpacked in registers
//
// Per pass 4 row groups; per block and group the 96 quant bytes are loaded (v0-v3 nibbles, v4-v5
// high bits) and unpacked into 8 vectors of 4 rows x 4 elements holding 4q as int8 (the stored
// high bits are XOR 2, so `shl` of the high-bit byte to bit 6 and `sri` of the nibble to bits
// 2..6 is the whole unpack), then 4 `sdot`s per half:
//     v6-v11, v4, v5   chunks 0..8 (elements 4c..4c + 4 of the 4 rows)
//     v12              nibble temporary;  v24  0xF0 mask
//     v16-v19          accumulators of groups 0..3;  v20-v23  their super-block scales d (f32)
//     v25              lane 0: the activation's d;  v26, v27  its 32 quants
//     v28, v29         the half dots;  v30, v31  the halves' scales f16(d * sc) (f32)
// With FEAT_FP16 the scales are one f16 multiply of 8 lanes (d kept twice as f16 in v20-v23).
// The scale plane of a group is read in order: d[4] at each super-block, then 8 int8 scales per
// block ([sc_lo r0..4, sc_hi r0..4]).

/// One Q6K group's block: unpack, dots, the halves' scales (`$sc`), `F += (dot_lo s_lo + dot_hi
/// s_hi) d_a`.
#[rustfmt::skip]
macro_rules! q6k_group { ($wq:ident, $ws:ident, $f:literal, $d:literal, $sc:ident) => { concat!(
    "ld1 {{v0.16b, v1.16b, v2.16b, v3.16b}}, [", op!($wq), "], #64\n",
    "ld1 {{v4.16b, v5.16b}}, [", op!($wq), "], #32\n",
    "shl v6.16b, v4.16b, #6\n",      "shl v7.16b, v5.16b, #6\n",
    "shl v8.16b, v4.16b, #4\n",      "shl v9.16b, v5.16b, #4\n",
    "shl v10.16b, v4.16b, #2\n",     "shl v11.16b, v5.16b, #2\n",
    "and v12.16b, v0.16b, v24.16b\n", "sri v10.16b, v12.16b, #2\n",
    "and v12.16b, v1.16b, v24.16b\n", "sri v11.16b, v12.16b, #2\n",
    "and v12.16b, v2.16b, v24.16b\n", "sri v4.16b, v12.16b, #2\n",
    "and v12.16b, v3.16b, v24.16b\n", "sri v5.16b, v12.16b, #2\n",
    "shl v0.16b, v0.16b, #4\n",      "sri v6.16b, v0.16b, #2\n",
    "shl v1.16b, v1.16b, #4\n",      "sri v7.16b, v1.16b, #2\n",
    "shl v2.16b, v2.16b, #4\n",      "sri v8.16b, v2.16b, #2\n",
    "shl v3.16b, v3.16b, #4\n",      "sri v9.16b, v3.16b, #2\n",
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    "sdot v28.4s, v6.16b, v26.4b[0]\n",  "sdot v29.4s, v10.16b, v27.4b[0]\n",
    "sdot v28.4s, v7.16b, v26.4b[1]\n",  "sdot v29.4s, v11.16b, v27.4b[1]\n",
    "sdot v28.4s, v8.16b, v26.4b[2]\n",  "sdot v29.4s, v4.16b, v27.4b[2]\n",
    "sdot v28.4s, v9.16b, v26.4b[3]\n",  "sdot v29.4s, v5.16b, v27.4b[3]\n",
    $sc!($ws, $d),
    "scvtf v28.4s, v28.4s, #2\n",    "scvtf v29.4s, v29.4s, #2\n",
    "fmul v28.4s, v28.4s, v30.4s\n", "fmla v28.4s, v29.4s, v31.4s\n",
    "fmla v", $f, ".4s, v28.4s, v25.s[0]\n",
) } }

/// The halves' scales f16(d * sc) into v30/v31 (f32), d in f32 (`v$d.4s`).
#[rustfmt::skip]
macro_rules! q6k_sc_f32 { ($ws:ident, $d:literal) => { concat!(
    "ldr d30, [", op!($ws), "], #8\n",
    "sxtl v30.8h, v30.8b\n",
    "sxtl2 v31.4s, v30.8h\n",        "sxtl v30.4s, v30.4h\n",
    "scvtf v30.4s, v30.4s\n",        "scvtf v31.4s, v31.4s\n",
    "fmul v30.4s, v30.4s, v", $d, ".4s\n",  "fmul v31.4s, v31.4s, v", $d, ".4s\n",
    "fcvtn v30.4h, v30.4s\n",        "fcvtn v31.4h, v31.4s\n",
    "fcvtl v30.4s, v30.4h\n",        "fcvtl v31.4s, v31.4h\n",
) } }
/// As `q6k_sc_f32` in FEAT_FP16 arithmetic (d twice in `v$d.8h`): one f16 product of the exact
/// operands is the f32 product rounded to f16, the same value.
#[rustfmt::skip]
macro_rules! q6k_sc_f16 { ($ws:ident, $d:literal) => { concat!(
    "ldr d30, [", op!($ws), "], #8\n",
    "sxtl v30.8h, v30.8b\n",
    "scvtf v30.8h, v30.8h\n",
    "fmul v30.8h, v30.8h, v", $d, ".8h\n",
    "fcvtl2 v31.4s, v30.8h\n",       "fcvtl v30.4s, v30.4h\n",
) } }
/// The 4 groups' super-block scales d into v20-v23: f32, or twice f16.
#[rustfmt::skip]
macro_rules! q6k_d_f32 { () => { concat!(
    "ldr d20, [{ws0}], #8\n", "ldr d21, [{ws1}], #8\n", "ldr d22, [{ws2}], #8\n", "ldr d23, [{ws3}], #8\n",
    "fcvtl v20.4s, v20.4h\n", "fcvtl v21.4s, v21.4h\n", "fcvtl v22.4s, v22.4h\n", "fcvtl v23.4s, v23.4h\n",
) } }
#[rustfmt::skip]
macro_rules! q6k_d_f16 { () => { concat!(
    "ldr d20, [{ws0}], #8\n", "ldr d21, [{ws1}], #8\n", "ldr d22, [{ws2}], #8\n", "ldr d23, [{ws3}], #8\n",
    "dup v20.2d, v20.d[0]\n", "dup v21.2d, v21.d[0]\n", "dup v22.2d, v22.d[0]\n", "dup v23.2d, v23.d[0]\n",
) } }

/// Defines a single-token pass of Q6K ([`Gemv4`]): 4 groups (quant and scale planes at `wq`, `ws`, block 0)
/// against one activation row `a` of `8 nsup` blocks; writes 16 floats at `o`.
#[rustfmt::skip]
macro_rules! q6k_gemv_kernel { ($name:ident, $features:literal, $dl:ident, $sc:ident) => {
    /// # Safety
    /// Each `wq[i]` readable for `96 * 8 nsup` bytes and `ws[i]` for `72 nsup`, `a` for `8 nsup`
    /// blocks, `o` writable for 16 floats, `nsup > 0`; the CPU has the target features.
    #[target_feature(enable = $features)]
    unsafe fn $name(wq: [*const u8; 4], ws: [*const u8; 4], a: *const ActBlock, nsup: usize, o: *mut f32) {
        // SAFETY: by the contract every load stays inside the planes and the row, the store
        // inside `o`; every register written is declared clobbered.
        unsafe {
            asm!(
                "movi v24.16b, #0xf0",
                "movi v16.4s, #0", "movi v17.4s, #0", "movi v18.4s, #0", "movi v19.4s, #0",
                "1:",
                $dl!(),
                "mov {k}, #8",
                "2:",
                "ldr s25, [{a}], #8",
                "ld1 {{v26.16b, v27.16b}}, [{a}], #32",
                q6k_group!(wq0, ws0, "16", "20", $sc),
                q6k_group!(wq1, ws1, "17", "21", $sc),
                q6k_group!(wq2, ws2, "18", "22", $sc),
                q6k_group!(wq3, ws3, "19", "23", $sc),
                "subs {k}, {k}, #1",
                "b.ne 2b",
                "subs {nsup}, {nsup}, #1",
                "b.ne 1b",
                "st1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{o}]",
                wq0 = inout(reg) wq[0] => _, wq1 = inout(reg) wq[1] => _,
                wq2 = inout(reg) wq[2] => _, wq3 = inout(reg) wq[3] => _,
                ws0 = inout(reg) ws[0] => _, ws1 = inout(reg) ws[1] => _,
                ws2 = inout(reg) ws[2] => _, ws3 = inout(reg) ws[3] => _,
                a = inout(reg) a => _,
                nsup = inout(reg) nsup => _,
                k = out(reg) _,
                o = in(reg) o,
                zp = in(reg) ZEROS.as_ptr(),
                out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                out("v12") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                options(nostack),
            );
        }
    }
} }

q6k_gemv_kernel!(q6k_gemv4, "dotprod", q6k_d_f32, q6k_sc_f32);
q6k_gemv_kernel!(q6k_gemv4_fp16, "dotprod,fp16", q6k_d_f16, q6k_sc_f16);

/// A single-token pass over 4 row groups of a narrow format (`q6k_gemv4`, `q5_gemv4`, ...): the
/// groups' quant and scale planes, the activation row, the kernel's loop count (blocks, or
/// super-blocks for Q6K) and 16 output floats.
type Gemv4 = unsafe fn([*const u8; 4], [*const u8; 4], *const ActBlock, usize, *mut f32);

/// One token against a narrow format (the contract of [`crate::kernels::packed::matmul_ref`]):
/// passes of 4 groups of `kernel`; a tail of 1 to 3 groups runs as a pass with its last group
/// repeated, into a spare.
///
/// # Safety
/// The CPU has `kernel`'s features; `kernel` is the single-token pass of `w`'s format and `count`
/// its loop count for `w`'s rows.
unsafe fn gemv_passes(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    kernel: Gemv4,
    count: usize,
) {
    let Some(_) = matmul_tokens(w, &groups, acts, outs) else { return };
    let (act, out) = (acts[0], &mut *outs[0]);
    let mut g = groups.start;
    while g < groups.end {
        let n = (groups.end - g).min(4);
        let pick = |i: usize| g + i.min(n - 1);
        let wq = core::array::from_fn(|i| w.group_quants(pick(i)).as_ptr());
        let ws = core::array::from_fn(|i| w.group_scales(pick(i)).as_ptr());
        let mut spare = [0f32; 16];
        // SAFETY: `matmul_tokens` checked the planes (consistent: every group has the blocks,
        // units and bytes `kernel` reads for `count`), the activation row (>= nb blocks) and the
        // output row; `spare` holds 16 floats; the CPU has the kernel's features (our contract).
        unsafe { kernel(wq, ws, act.as_ptr(), count, spare.as_mut_ptr()) };
        let at = GROUP_ROWS * (g - groups.start);
        out[at..at + GROUP_ROWS * n].copy_from_slice(&spare[..GROUP_ROWS * n]);
        g += n;
    }
}

// ---------------------------------------------------------------------------------------------
// Q5, one token: unpacked in registers
//
// Per pass 4 row groups; per block and group the 80 quant bytes are loaded (v0-v3 nibbles, v4 the
// bit plane) and unpacked into 8 vectors of 4 rows x 4 elements holding 8q as int8 (the stored bit
// is XOR 1, so `shl` of the bit byte to bit 7 and `sri` by 1 of the nibble held at bits 4..8 is the
// whole unpack), then 8 `sdot`s:
//     v5-v11, v4       chunks 0..8 (elements 4c..4c + 4 of the 4 rows)
//     v12              nibble temporary;  v24  0xF0 mask
//     v16-v19          accumulators of groups 0..3
//     v25              lane 0: the activation's d;  v26, v27  its 32 quants
//     v28              the block dot;  v30  the group's row scales d (f32)

/// One Q5 group's block: unpack, dots, `F += (dot / 8 * d_w) * d_a`. The scale piece `$sc` loads
/// the row scales (v30; Q5Min: mins in v31) and turns the dot of `8q` into that of the format's
/// values (Q5Min: `8u = 8q + 128`, v29 holding `128 sum(a)`).
#[rustfmt::skip]
macro_rules! q5_group { ($wq:ident, $ws:ident, $f:literal, $sc:ident) => { concat!(
    "ld1 {{v0.16b, v1.16b, v2.16b, v3.16b}}, [", op!($wq), "], #64\n",
    "ldr q4, [", op!($wq), "], #16\n",
    "shl v5.16b, v4.16b, #7\n",      "shl v12.16b, v0.16b, #4\n",    "sri v5.16b, v12.16b, #1\n",
    "shl v6.16b, v4.16b, #6\n",      "shl v12.16b, v1.16b, #4\n",    "sri v6.16b, v12.16b, #1\n",
    "shl v7.16b, v4.16b, #5\n",      "shl v12.16b, v2.16b, #4\n",    "sri v7.16b, v12.16b, #1\n",
    "shl v8.16b, v4.16b, #4\n",      "shl v12.16b, v3.16b, #4\n",    "sri v8.16b, v12.16b, #1\n",
    "shl v9.16b, v4.16b, #3\n",      "and v12.16b, v0.16b, v24.16b\n", "sri v9.16b, v12.16b, #1\n",
    "shl v10.16b, v4.16b, #2\n",     "and v12.16b, v1.16b, v24.16b\n", "sri v10.16b, v12.16b, #1\n",
    "shl v11.16b, v4.16b, #1\n",     "and v12.16b, v2.16b, v24.16b\n", "sri v11.16b, v12.16b, #1\n",
    "and v12.16b, v3.16b, v24.16b\n", "sri v4.16b, v12.16b, #1\n",
    "movi v28.4s, #0\n",
    "sdot v28.4s, v5.16b, v26.4b[0]\n",  "sdot v28.4s, v6.16b, v26.4b[1]\n",
    "sdot v28.4s, v7.16b, v26.4b[2]\n",  "sdot v28.4s, v8.16b, v26.4b[3]\n",
    "sdot v28.4s, v9.16b, v27.4b[0]\n",  "sdot v28.4s, v10.16b, v27.4b[1]\n",
    "sdot v28.4s, v11.16b, v27.4b[2]\n", "sdot v28.4s, v4.16b, v27.4b[3]\n",
    $sc!($ws, $f),
) } }

/// Q5: `F += (dot / 8 * d) * d_a`.
#[rustfmt::skip]
macro_rules! q5_sc { ($ws:ident, $f:literal) => { concat!(
    "ldr d30, [", op!($ws), "], #8\n",
    "fcvtl v30.4s, v30.4h\n",
    "scvtf v28.4s, v28.4s, #3\n",
    "fmul v28.4s, v28.4s, v30.4s\n",
    "fmla v", $f, ".4s, v28.4s, v25.s[0]\n",
) } }
/// Q5Min: `F += (dot(u) * d) * d_a + m * s_a`.
#[rustfmt::skip]
macro_rules! q5m_sc { ($ws:ident, $f:literal) => { concat!(
    "ldr q30, [", op!($ws), "], #16\n",
    "add v28.4s, v28.4s, v29.4s\n",
    "fcvtl2 v31.4s, v30.8h\n",      "fcvtl v30.4s, v30.4h\n",
    "scvtf v28.4s, v28.4s, #3\n",
    "fmul v28.4s, v28.4s, v30.4s\n",
    "fmla v", $f, ".4s, v28.4s, v25.s[0]\n",
    "fmla v", $f, ".4s, v31.4s, v25.s[1]\n",
) } }

/// Per block before the groups: Q5 nothing; Q5Min `128 sum(a)` in every lane of v29 (two `sdot`s
/// with ones in v23, an across-lanes add).
#[rustfmt::skip]
macro_rules! q5_head { () => { "" } }
#[rustfmt::skip]
macro_rules! q5m_head { () => { concat!(
    "movi v29.4s, #0\n",
    "sdot v29.4s, v26.16b, v23.16b\n",  "sdot v29.4s, v27.16b, v23.16b\n",
    "addv s29, v29.4s\n",
    "shl v29.4s, v29.4s, #7\n",
    "dup v29.4s, v29.s[0]\n",
) } }

/// Defines a single-token pass of Q5 or Q5Min ([`Gemv4`]): 4 groups (quant and scale planes at `wq`, `ws`, block 0) against
/// one activation row `a` of `nb` blocks; writes 16 floats at `o`.
#[rustfmt::skip]
macro_rules! q5_gemv_kernel { ($name:ident, $head:ident, $sc:ident) => {
    /// # Safety
    /// Each `wq[i]` readable for `80 nb` bytes and `ws[i]` for the format's scale bytes of `nb`
    /// blocks, `a` for `nb` blocks, `o` writable for 16 floats, `nb > 0`; the CPU has dotprod.
    #[target_feature(enable = "dotprod")]
    unsafe fn $name(wq: [*const u8; 4], ws: [*const u8; 4], a: *const ActBlock, nb: usize, o: *mut f32) {
        // SAFETY: by the contract every load stays inside the planes and the row, the store
        // inside `o`; every register written is declared clobbered.
        unsafe {
            asm!(
                "movi v24.16b, #0xf0",
                "movi v23.16b, #1",
                "movi v16.4s, #0", "movi v17.4s, #0", "movi v18.4s, #0", "movi v19.4s, #0",
                "2:",
                "ldr d25, [{a}], #8",
                "ld1 {{v26.16b, v27.16b}}, [{a}], #32",
                $head!(),
                q5_group!(wq0, ws0, "16", $sc),
                q5_group!(wq1, ws1, "17", $sc),
                q5_group!(wq2, ws2, "18", $sc),
                q5_group!(wq3, ws3, "19", $sc),
                "subs {nb}, {nb}, #1",
                "b.ne 2b",
                "st1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{o}]",
                wq0 = inout(reg) wq[0] => _, wq1 = inout(reg) wq[1] => _,
                wq2 = inout(reg) wq[2] => _, wq3 = inout(reg) wq[3] => _,
                ws0 = inout(reg) ws[0] => _, ws1 = inout(reg) ws[1] => _,
                ws2 = inout(reg) ws[2] => _, ws3 = inout(reg) ws[3] => _,
                a = inout(reg) a => _,
                nb = inout(reg) nb => _,
                o = in(reg) o,
                out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                out("v12") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v23") _, out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                options(nostack),
            );
        }
    }
} }

q5_gemv_kernel!(q5_gemv4, q5_head, q5_sc);
q5_gemv_kernel!(q5m_gemv4, q5m_head, q5m_sc);

/// [`crate::kernels::widen::widen_ref`] for Q5 and Q5Min on NEON: per output vector of 4 rows x 4 elements,
/// the high bit shifted to the top (`shl`) and the low nibble inserted below it (`sri` by 1 of the
/// nibble held at bits 4..8) make `8q`, and an arithmetic shift (`sshr`) gives `q`.
pub fn widen_q5(w: &PackedMatrix<'_>, g: usize, blocks: Range<usize>, quants: &mut [u8], scales: &mut [u8]) {
    let (gq, gs) = (w.group_quants(g), w.group_scales(g));
    let (qb, sb, wq) = (w.format.quant_bytes(), w.format.scale_bytes(), PackedFormat::Q8.quant_bytes());
    // Q5Min widens to its unsigned values u = q + 16.
    let offset = if w.format == PackedFormat::Q5Min { 16 } else { 0 };
    for (i, b) in blocks.enumerate() {
        let src = &gq[b * qb..(b + 1) * qb];
        let dst = &mut quants[i * wq..(i + 1) * wq];
        // SAFETY: NEON is part of the aarch64 baseline; `src` holds 80 bytes and `dst` 128 (the
        // slices above), every load and store is inside them.
        unsafe {
            let n: [uint8x16_t; 4] = core::array::from_fn(|c| vld1q_u8(src[16 * c..].as_ptr()));
            let h = vld1q_u8(src[64..].as_ptr());
            let hi = vdupq_n_u8(0xF0);
            let lo = |c: usize| if c < 4 { vshlq_n_u8::<4>(n[c]) } else { vandq_u8(n[c - 4], hi) };
            let out = [
                vsriq_n_u8::<1>(vshlq_n_u8::<7>(h), lo(0)),
                vsriq_n_u8::<1>(vshlq_n_u8::<6>(h), lo(1)),
                vsriq_n_u8::<1>(vshlq_n_u8::<5>(h), lo(2)),
                vsriq_n_u8::<1>(vshlq_n_u8::<4>(h), lo(3)),
                vsriq_n_u8::<1>(vshlq_n_u8::<3>(h), lo(4)),
                vsriq_n_u8::<1>(vshlq_n_u8::<2>(h), lo(5)),
                vsriq_n_u8::<1>(vshlq_n_u8::<1>(h), lo(6)),
                vsriq_n_u8::<1>(h, lo(7)),
            ];
            for (c, v) in out.into_iter().enumerate() {
                let q = vaddq_s8(vshrq_n_s8::<3>(vreinterpretq_s8_u8(v)), vdupq_n_s8(offset));
                vst1q_s8(dst[16 * c..].as_mut_ptr().cast(), q);
            }
        }
        scales[i * sb..(i + 1) * sb].copy_from_slice(&gs[b * sb..(b + 1) * sb]);
    }
}

// ---------------------------------------------------------------------------------------------
// Q6K widened to Q8Sub16 (see `crate::kernels::widen`)

/// [`crate::kernels::widen::widen_ref`] for Q6K on NEON: per output vector of 4 rows x 4 elements,
/// the high bits shifted to the top (`shl`) and the low nibble inserted below them (`sri`) make
/// `4q`, and an arithmetic shift (`sshr`) gives `q`.
pub fn widen_q6k(w: &PackedMatrix<'_>, g: usize, blocks: Range<usize>, quants: &mut [u8], scales: &mut [u8]) {
    let (gq, gs) = (w.group_quants(g), w.group_scales(g));
    let (qb, wq, ws) = (
        PackedFormat::Q6K.quant_bytes(),
        PackedFormat::Q8Sub16.quant_bytes(),
        PackedFormat::Q8Sub16.scale_bytes(),
    );
    for (i, b) in blocks.enumerate() {
        let src = &gq[b * qb..(b + 1) * qb];
        let dst = &mut quants[i * wq..(i + 1) * wq];
        // SAFETY: NEON is part of the aarch64 baseline; `src` holds 96 bytes and `dst` 128 (the
        // slices above), every load and store is inside them.
        unsafe {
            let n: [uint8x16_t; 4] = core::array::from_fn(|c| vld1q_u8(src[16 * c..].as_ptr()));
            let h = [vld1q_u8(src[64..].as_ptr()), vld1q_u8(src[80..].as_ptr())];
            let hi = vdupq_n_u8(0xF0);
            // Chunk c (elements 4c..4c + 4): low nibble of n[c] (c < 4) or high of n[c - 4]; high
            // bits at field c / 2 of h[c % 2].
            let lo = |c: usize| if c < 4 { vshlq_n_u8::<4>(n[c]) } else { vandq_u8(n[c - 4], hi) };
            let out = [
                vsriq_n_u8::<2>(vshlq_n_u8::<6>(h[0]), lo(0)),
                vsriq_n_u8::<2>(vshlq_n_u8::<6>(h[1]), lo(1)),
                vsriq_n_u8::<2>(vshlq_n_u8::<4>(h[0]), lo(2)),
                vsriq_n_u8::<2>(vshlq_n_u8::<4>(h[1]), lo(3)),
                vsriq_n_u8::<2>(vshlq_n_u8::<2>(h[0]), lo(4)),
                vsriq_n_u8::<2>(vshlq_n_u8::<2>(h[1]), lo(5)),
                vsriq_n_u8::<2>(h[0], lo(6)),
                vsriq_n_u8::<2>(h[1], lo(7)),
            ];
            for (c, v) in out.into_iter().enumerate() {
                let q = vshrq_n_s8::<2>(vreinterpretq_s8_u8(v));
                vst1q_s8(dst[16 * c..].as_mut_ptr().cast(), q);
            }
        }
        // Scales: f16(d * sc) of both halves' rows, in the order the Q6K plane keeps the int8 ones.
        let sup = &gs[(b / SUPER_BLOCKS) * SUPER_SCALE_BYTES..][..SUPER_SCALE_BYTES];
        let at = 8 + 8 * (b % SUPER_BLOCKS);
        let sc: &[u8; 8] = sup[at..at + 8].try_into().unwrap_or(&[0; 8]);
        // SAFETY: NEON is part of the aarch64 baseline; 8 bytes read from `sc`, 16 written to
        // the block's 16 scale bytes.
        unsafe {
            let d = f16x4_to_f32(&sup[..8]);
            let sc = vmovl_s8(vld1_s8(sc.as_ptr().cast()));
            let lo = vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(sc))));
            let hi = vmulq_f32(d, vcvtq_f32_s32(vmovl_high_s16(sc)));
            vst1q_u16(scales[i * ws..(i + 1) * ws].as_mut_ptr().cast(), f16_narrow(lo, hi));
        }
    }
}

/// [`crate::kernels::widen::q4k_scales_ref`] on NEON: the 64 6-bit fields of a unit as bytes
/// (nibble plane masked and shifted, the 2-bit plane shifted into bits 4..6), then per block the
/// 4 scales and 4 mins widened to f32, times `d` and `-dmin`, narrowed to f16. Lengths that do not
/// match write nothing.
pub fn q4k_scales(units: &[u8], out: &mut [u8]) {
    if !q4k_lengths_match(units, out) {
        return;
    }
    for (unit, out) in units.chunks_exact(Q4K_SCALE_BYTES).zip(out.chunks_exact_mut(Q4K_WIDE_UNIT)) {
        q4k_unit(unit, out);
    }
}

#[inline(always)]
fn q4k_unit(unit: &[u8], out: &mut [u8]) {
    let (Ok(unit), Ok(out)): (Result<&[u8; Q4K_SCALE_BYTES], _>, Result<&mut [u8; Q4K_WIDE_UNIT], _>) =
        (unit.try_into(), out.try_into())
    else {
        return;
    };
    // SAFETY: NEON is part of the aarch64 baseline; 48 bytes read from `unit` at 16, 128 written
    // to `out` (the arrays above).
    unsafe {
        let d = f16x4_to_f32(&unit[..8]);
        let neg_dmin = vnegq_f32(f16x4_to_f32(&unit[8..16]));
        let (lo0, lo1, hi) =
            (vld1q_u8(unit[16..].as_ptr()), vld1q_u8(unit[32..].as_ptr()), vld1q_u8(unit[48..].as_ptr()));
        let (m4, m30) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x30));
        // Scales and mins of blocks 0..4 and 4..8, one byte per row and block.
        let sc = [
            vorrq_u8(vandq_u8(lo0, m4), vandq_u8(vshlq_n_u8::<4>(hi), m30)),
            vorrq_u8(vandq_u8(lo1, m4), vandq_u8(vshlq_n_u8::<2>(hi), m30)),
        ];
        let mn = [
            vorrq_u8(vshrq_n_u8::<4>(lo0), vandq_u8(hi, m30)),
            vorrq_u8(vshrq_n_u8::<4>(lo1), vandq_u8(vshrq_n_u8::<2>(hi), m30)),
        ];
        for h in 0..2 {
            let (s16, m16) = (
                [vmovl_u8(vget_low_u8(sc[h])), vmovl_high_u8(sc[h])],
                [vmovl_u8(vget_low_u8(mn[h])), vmovl_high_u8(mn[h])],
            );
            for p in 0..4 {
                let (s, m) = (s16[p / 2], m16[p / 2]);
                let (s, m) = if p % 2 == 0 {
                    (vmovl_u16(vget_low_u16(s)), vmovl_u16(vget_low_u16(m)))
                } else {
                    (vmovl_high_u16(s), vmovl_high_u16(m))
                };
                let fs = vmulq_f32(vcvtq_f32_u32(s), d);
                let fm = vmulq_f32(vcvtq_f32_u32(m), neg_dmin);
                vst1q_u16(out[16 * (4 * h + p)..].as_mut_ptr().cast(), f16_narrow(fs, fm));
            }
        }
    }
}

/// [`q4k_scales`] in FEAT_FP16 arithmetic: per pair of blocks the 16 fields widen to f16 in one
/// `ucvtf` each half and one f16 multiply by `[d, -dmin]` gives both blocks' 8 scales (one
/// product of exact operands, rounded once: the f32 product rounded to f16, the same bytes). About
/// half the instructions of the f32 decoder. Lengths that do not match write nothing.
///
/// # Safety
/// The CPU must have FEAT_FP16.
#[target_feature(enable = "neon,fp16")]
pub unsafe fn q4k_scales_fp16(units: &[u8], out: &mut [u8]) {
    let n = units.len() / Q4K_SCALE_BYTES;
    if !q4k_lengths_match(units, out) || n == 0 {
        return;
    }
    // SAFETY: 64 bytes read from `units` and 128 written to `out` per unit, `n` units (the lengths
    // checked above); FEAT_FP16 is the caller's contract; every register written is declared
    // clobbered.
    unsafe {
        asm!(
            "movi v5.16b, #0x0f",
            "movi v6.16b, #0x30",
            "2:",
            // v0 = [d x4, -dmin x4] (f16); v1, v2 nibble planes; v3 2-bit plane.
            "ld1 {{v0.16b, v1.16b, v2.16b, v3.16b}}, [{u}], #64",
            "fneg v4.8h, v0.8h",
            "mov v0.d[1], v4.d[1]",
            // Scales (v7: blocks 0..4, v17: 4..8) and mins (v18, v19), a byte per row and block:
            // the nibble, and the 2-bit field moved to bits 4..6 and inserted there (`bit`).
            "and v7.16b, v1.16b, v5.16b",   "shl v16.16b, v3.16b, #4",  "bit v7.16b, v16.16b, v6.16b",
            "and v17.16b, v2.16b, v5.16b",  "shl v16.16b, v3.16b, #2",  "bit v17.16b, v16.16b, v6.16b",
            "ushr v18.16b, v1.16b, #4",     "bit v18.16b, v3.16b, v6.16b",
            "ushr v19.16b, v2.16b, #4",     "ushr v16.16b, v3.16b, #2", "bit v19.16b, v16.16b, v6.16b",
            // [sc, m] of blocks (0, 1), (2, 3), (4, 5), (6, 7).
            "zip1 v20.4s, v7.4s, v18.4s",   "zip2 v21.4s, v7.4s, v18.4s",
            "zip1 v22.4s, v17.4s, v19.4s",  "zip2 v23.4s, v17.4s, v19.4s",
            "uxtl v24.8h, v20.8b",  "uxtl2 v25.8h, v20.16b",
            "uxtl v26.8h, v21.8b",  "uxtl2 v27.8h, v21.16b",
            "uxtl v28.8h, v22.8b",  "uxtl2 v29.8h, v22.16b",
            "uxtl v30.8h, v23.8b",  "uxtl2 v31.8h, v23.16b",
            "ucvtf v24.8h, v24.8h", "ucvtf v25.8h, v25.8h",
            "ucvtf v26.8h, v26.8h", "ucvtf v27.8h, v27.8h",
            "ucvtf v28.8h, v28.8h", "ucvtf v29.8h, v29.8h",
            "ucvtf v30.8h, v30.8h", "ucvtf v31.8h, v31.8h",
            "fmul v24.8h, v24.8h, v0.8h", "fmul v25.8h, v25.8h, v0.8h",
            "fmul v26.8h, v26.8h, v0.8h", "fmul v27.8h, v27.8h, v0.8h",
            "fmul v28.8h, v28.8h, v0.8h", "fmul v29.8h, v29.8h, v0.8h",
            "fmul v30.8h, v30.8h, v0.8h", "fmul v31.8h, v31.8h, v0.8h",
            "st1 {{v24.8h, v25.8h, v26.8h, v27.8h}}, [{o}], #64",
            "st1 {{v28.8h, v29.8h, v30.8h, v31.8h}}, [{o}], #64",
            "subs {n}, {n}, #1",
            "b.ne 2b",
            u = inout(reg) units.as_ptr() => _,
            o = inout(reg) out.as_mut_ptr() => _,
            n = inout(reg) n => _,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
            out("v6") _, out("v7") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
            out("v20") _, out("v21") _, out("v22") _, out("v23") _, out("v24") _, out("v25") _,
            out("v26") _, out("v27") _, out("v28") _, out("v29") _, out("v30") _, out("v31") _,
            options(nostack),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Packed matmul without `sdot` (A72/A53-class cores)

/// Packed matmul without the dot-product extension: per 4 activation quants broadcast over the 4
/// rows, `smull`/`smlal` pairs of int8 products into int16 (two products of |16 q| <= 128 and
/// |a| <= 127 fit), `sadalp` into int32. One token runs 4 groups per pass (sharing the
/// broadcasts), several run 1 group x 4 tokens (sharing the unpacked weights).
pub fn matmul(w: &PackedMatrix<'_>, groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]) {
    if matches!(w.format, PackedFormat::Q4K | PackedFormat::Q5K) {
        return crate::kernels::widen::matmul_decoded(
            crate::kernels::KernelPath::Neon,
            w,
            groups,
            acts,
            outs,
        );
    }
    if matches!(w.format, PackedFormat::Q6K | PackedFormat::Q5 | PackedFormat::Q5Min) {
        return crate::kernels::widen::matmul_widened(
            crate::kernels::KernelPath::Neon,
            w,
            groups,
            acts,
            outs,
        );
    }
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    // SAFETY: NEON is part of the aarch64 baseline (every arm).
    unsafe {
        match w.format {
            PackedFormat::Q4 => matmul_neon::<FMT_Q4>(w, groups, acts, outs, n),
            // (Q4K went through `matmul_decoded`, which calls back with Q4Min.)
            PackedFormat::Q4Min | PackedFormat::Q4K => matmul_neon::<FMT_Q4MIN>(w, groups, acts, outs, n),
            PackedFormat::Q8 | PackedFormat::Q5 => matmul_neon::<FMT_Q8>(w, groups, acts, outs, n),
            PackedFormat::Q8Min | PackedFormat::Q5Min | PackedFormat::Q5K => {
                matmul_neon::<FMT_Q8MIN>(w, groups, acts, outs, n)
            }
            PackedFormat::Q8Sub16 | PackedFormat::Q6K => matmul_neon::<FMT_Q8SUB16>(w, groups, acts, outs, n),
        }
    }
}

// The formats as const parameters, so each gets its own inner loops.
const FMT_Q4: u8 = 0;
const FMT_Q4MIN: u8 = 1;
const FMT_Q8: u8 = 2;
const FMT_Q8MIN: u8 = 3;
const FMT_Q8SUB16: u8 = 4;

#[target_feature(enable = "neon")]
fn matmul_neon<const F: u8>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    n: usize,
) {
    let nb = w.blocks();
    let mut g = groups.start;
    if n == 1 {
        let (act, out) = (acts[0], &mut *outs[0]);
        while groups.end - g >= 4 {
            let planes = core::array::from_fn(|i| (w.group_quants(g + i), w.group_scales(g + i)));
            let f = groups_gemv::<F>(planes, act, nb);
            st_f32x16(&mut out[GROUP_ROWS * (g - groups.start)..], f);
            g += 4;
        }
    }
    for g in g..groups.end {
        let (q, s) = (w.group_quants(g), w.group_scales(g));
        let gi = g - groups.start;
        let mut t = 0;
        while t < n {
            if let Ok(a) = <&[&[ActBlock]; 4]>::try_from(&acts[t..n.min(t + 4)]) {
                let f = group_tokens::<F, 4>(q, s, a, nb);
                for (f, o) in f.iter().zip(outs[t..t + 4].iter_mut()) {
                    st_f32x4(&mut o[GROUP_ROWS * gi..], *f);
                }
                t += 4;
            } else {
                let [f] = group_tokens::<F, 1>(q, s, &[acts[t]], nb);
                st_f32x4(&mut outs[t][GROUP_ROWS * gi..], f);
                t += 1;
            }
        }
    }
}

/// One token against 4 groups (their quant and scale planes): the activation broadcasts are
/// shared by the groups.
#[target_feature(enable = "neon")]
#[inline]
fn groups_gemv<const F: u8>(planes: [(&[u8], &[u8]); 4], act: &[ActBlock], nb: usize) -> [float32x4_t; 4] {
    let (qb, sb) = block_bytes::<F>();
    let mut f = [vdupq_n_f32(0.0); 4];
    for (b, a) in act[..nb].iter().enumerate() {
        let x = broadcasts(a);
        for (f, (q, s)) in f.iter_mut().zip(planes) {
            let wv = weights::<F>(&q[b * qb..(b + 1) * qb]);
            let (d, m) = scales::<F>(&s[b * sb..(b + 1) * sb]);
            *f = accumulate::<F>(*f, &wv, &x, d, m, a);
        }
    }
    f
}

/// Quant and scale bytes per group and block of format `F`.
const fn block_bytes<const F: u8>() -> (usize, usize) {
    match F {
        FMT_Q4 => (64, 8),
        FMT_Q4MIN => (64, 16),
        FMT_Q8 => (128, 8),
        _ => (128, 16),
    }
}

/// One group against `T` tokens: the unpacked weights are shared by the tokens.
#[target_feature(enable = "neon")]
#[inline]
fn group_tokens<const F: u8, const T: usize>(
    q: &[u8],
    s: &[u8],
    acts: &[&[ActBlock]; T],
    nb: usize,
) -> [float32x4_t; T] {
    let (qb, sb) = block_bytes::<F>();
    let mut f = [vdupq_n_f32(0.0); T];
    for b in 0..nb {
        let wv = weights::<F>(&q[b * qb..(b + 1) * qb]);
        let (d, m) = scales::<F>(&s[b * sb..(b + 1) * sb]);
        for (f, act) in f.iter_mut().zip(acts) {
            let a = &act[b];
            *f = accumulate::<F>(*f, &wv, &broadcasts(a), d, m, a);
        }
    }
    f
}

/// A group's block as 8 vectors of 4 rows x 4 elements (elements 0..16, then 16..32; 4-bit
/// values x16).
#[target_feature(enable = "neon")]
#[inline]
fn weights<const F: u8>(wq: &[u8]) -> [int8x16_t; 8] {
    if F == FMT_Q4 || F == FMT_Q4MIN {
        let mask = vdupq_n_s8(0xF0u8 as i8);
        let x: [int8x16_t; 4] = core::array::from_fn(|c| ld_s8x16(&wq[16 * c..]));
        core::array::from_fn(|c| if c < 4 { vshlq_n_s8::<4>(x[c]) } else { vandq_s8(x[c - 4], mask) })
    } else {
        core::array::from_fn(|c| ld_s8x16(&wq[16 * c..]))
    }
}

/// A group's row scales `d` and second scales (`m`, `m + 8 d` for Q4Min, or the scales of
/// elements 16..32).
#[target_feature(enable = "neon")]
#[inline]
fn scales<const F: u8>(sc: &[u8]) -> (float32x4_t, float32x4_t) {
    let d = f16x4_to_f32(&sc[..8]);
    if F == FMT_Q4 || F == FMT_Q8 {
        return (d, d);
    }
    let m = f16x4_to_f32(&sc[8..16]);
    (d, if F == FMT_Q4MIN { vfmaq_n_f32(m, d, 8.0) } else { m })
}

/// The 8 groups of 4 activation quants, each broadcast over a vector.
#[target_feature(enable = "neon")]
#[inline]
fn broadcasts(a: &ActBlock) -> [int8x16_t; 8] {
    let (lo, hi) = (vreinterpretq_s32_s8(ld_i8x16(&a.qs[..16])), vreinterpretq_s32_s8(ld_i8x16(&a.qs[16..])));
    let b = |v: int32x4_t| vreinterpretq_s8_s32(v);
    [
        b(vdupq_laneq_s32::<0>(lo)),
        b(vdupq_laneq_s32::<1>(lo)),
        b(vdupq_laneq_s32::<2>(lo)),
        b(vdupq_laneq_s32::<3>(lo)),
        b(vdupq_laneq_s32::<0>(hi)),
        b(vdupq_laneq_s32::<1>(hi)),
        b(vdupq_laneq_s32::<2>(hi)),
        b(vdupq_laneq_s32::<3>(hi)),
    ]
}

/// One block of one token added to the accumulator `f`.
#[target_feature(enable = "neon")]
#[inline]
fn accumulate<const F: u8>(
    f: float32x4_t,
    w: &[int8x16_t; 8],
    x: &[int8x16_t; 8],
    d: float32x4_t,
    m: float32x4_t,
    a: &ActBlock,
) -> float32x4_t {
    // Per pair of weight vectors: rows 0, 1 (low halves) and rows 2, 3 (high halves) as int16.
    let p: [(int16x8_t, int16x8_t); 4] =
        core::array::from_fn(|i| mul_pair(w[2 * i], w[2 * i + 1], x[2 * i], x[2 * i + 1]));
    // Pairwise sums into [r0, r0, r1, r1] and [r2, r2, r3, r3], then one lane per row.
    let half = |p: &[(int16x8_t, int16x8_t)]| {
        let lo = vpadalq_s16(vpaddlq_s16(p[0].0), p[1].0);
        let hi = vpadalq_s16(vpaddlq_s16(p[0].1), p[1].1);
        (lo, hi)
    };
    if F == FMT_Q8SUB16 {
        let ((l0, h0), (l1, h1)) = (half(&p[..2]), half(&p[2..]));
        let x = vmulq_f32(vcvtq_f32_s32(vpaddq_s32(l0, h0)), d);
        let x = vfmaq_f32(x, vcvtq_f32_s32(vpaddq_s32(l1, h1)), m);
        return vfmaq_n_f32(f, x, a.d);
    }
    let (lo, hi) = half(&p[..2]);
    let (lo, hi) =
        (vpadalq_s16(vpadalq_s16(lo, p[2].0), p[3].0), vpadalq_s16(vpadalq_s16(hi, p[2].1), p[3].1));
    let dot = vpaddq_s32(lo, hi);
    let dot = if F == FMT_Q4 || F == FMT_Q4MIN { vcvtq_n_f32_s32::<4>(dot) } else { vcvtq_f32_s32(dot) };
    let f = vfmaq_n_f32(f, vmulq_f32(dot, d), a.d);
    if F == FMT_Q4MIN || F == FMT_Q8MIN {
        vfmaq_n_f32(f, m, a.s)
    } else {
        f
    }
}

/// `w0 * x0 + w1 * x1` per byte lane as int16: low halves (rows 0, 1) and high halves (rows 2, 3).
#[inline(always)]
fn mul_pair(w0: int8x16_t, w1: int8x16_t, x0: int8x16_t, x1: int8x16_t) -> (int16x8_t, int16x8_t) {
    let (lo, hi): (int16x8_t, int16x8_t);
    // SAFETY: register-only arithmetic (base AdvSIMD).
    unsafe {
        asm!(
            "smull {lo:v}.8h, {w0:v}.8b, {x0:v}.8b",
            "smull2 {hi:v}.8h, {w0:v}.16b, {x0:v}.16b",
            "smlal {lo:v}.8h, {w1:v}.8b, {x1:v}.8b",
            "smlal2 {hi:v}.8h, {w1:v}.16b, {x1:v}.16b",
            lo = out(vreg) lo, hi = out(vreg) hi,
            w0 = in(vreg) w0, w1 = in(vreg) w1, x0 = in(vreg) x0, x1 = in(vreg) x1,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    (lo, hi)
}

// ---------------------------------------------------------------------------------------------
// Activation quantization

/// Activation quantization; the same bytes as `packed::quantize_act_ref`.
pub fn quantize_act(x: &[f32], out: &mut [ActBlock]) {
    debug_assert_eq!(x.len(), out.len() * BLOCK);
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { quantize_act_neon(x, out) }
}

#[target_feature(enable = "neon")]
fn quantize_act_neon(x: &[f32], out: &mut [ActBlock]) {
    let zero = vdupq_n_f32(0.0);
    for (x, b) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let v: [float32x4_t; 8] = core::array::from_fn(|i| ld_f32x4(&x[4 * i..]));
        // max(0, |v|...) ignoring NaNs, like the reference's fold.
        let m = |a: float32x4_t, b: float32x4_t| vmaxnmq_f32(vabsq_f32(a), vabsq_f32(b));
        let m = vmaxnmq_f32(
            vmaxnmq_f32(m(v[0], v[1]), m(v[2], v[3])),
            vmaxnmq_f32(vmaxnmq_f32(m(v[4], v[5]), m(v[6], v[7])), zero),
        );
        let amax = vmaxnmvq_f32(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        if id == f32::INFINITY {
            // amax < 127 / f32::MAX: the products saturate, which the narrowing below would not.
            quantize_act_ref(x, core::slice::from_mut(b));
            continue;
        }
        // Round half to even, as rintf.
        let q: [int32x4_t; 8] = core::array::from_fn(|i| vcvtnq_s32_f32(vmulq_n_f32(v[i], id)));
        let h = |a: int32x4_t, b: int32x4_t| vuzp1q_s16(vreinterpretq_s16_s32(a), vreinterpretq_s16_s32(b));
        let h = [h(q[0], q[1]), h(q[2], q[3]), h(q[4], q[5]), h(q[6], q[7])];
        let sum = vaddlvq_s16(vaddq_s16(vaddq_s16(h[0], h[1]), vaddq_s16(h[2], h[3])));
        let lo = vuzp1q_s8(vreinterpretq_s8_s16(h[0]), vreinterpretq_s8_s16(h[1]));
        let hi = vuzp1q_s8(vreinterpretq_s8_s16(h[2]), vreinterpretq_s8_s16(h[3]));
        let (qlo, qhi) = b.qs.split_at_mut(16);
        // SAFETY: writes the 16 bytes of each half.
        unsafe {
            vst1q_s8(qlo.as_mut_ptr(), lo);
            vst1q_s8(qhi.as_mut_ptr(), hi);
        }
        let ds = vcombine_f32(vset_lane_f32::<1>(d * sum as f32, vdup_n_f32(d)), vdup_n_f32(0.0));
        let ds = f16_round4(ds);
        b.d = vgetq_lane_f32::<0>(ds);
        b.s = vgetq_lane_f32::<1>(ds);
    }
}
