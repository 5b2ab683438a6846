//! aarch64 NEON kernels (with and without `sdot`), twins of `packed` and `reference`.
//!
//! The `sdot` matmuls are `asm!` loops: the dot-product intrinsics are unstable on our compiler, and
//! decode speed comes down to the instructions spent per weight block. Everything else uses
//! intrinsics inside `#[target_feature(enable = "neon")]` functions (NEON is in the aarch64
//! baseline, so calling them is always sound); f16 <-> f32 goes through `fcvtl`/`fcvtn` instead of
//! the `half` crate's software conversion.

use core::arch::aarch64::*;
use core::arch::asm;
use core::ops::Range;

use super::packed::{quantize_act_ref, ActBlock, PackedFormat, PackedMatrix, BLOCK, GROUP_ROWS};
use super::reference::{
    f32_to_f16_ref, flash_attn_row_f32dot_ref, flash_attn_rows_f16arith_ref, flash_attn_rows_f32dot_ref,
    rope_rotate_ref, swiglu_ref, FLASH_ROWS,
};
use crate::quant::blocks::F16Le;

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
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn matmul_dotprod(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    let (gemv, tiles): (DotKernel, &[DotKernel]) = match w.format {
        PackedFormat::Q4 => (q4_gemv, &[q4_t1, q4_t2, q4_t3, q4_t4]),
        PackedFormat::Q8 => (q8_gemv, &[q8_t1, q8_t2, q8_t3, q8_t4]),
        PackedFormat::Q4Min => (q4m_gemv, &[q4m_t1, q4m_t2, q4m_t3]),
        PackedFormat::Q8Min => (q8m_gemv, &[q8m_t1, q8m_t2, q8m_t3]),
        PackedFormat::Q8Sub16 => (q8s_gemv, &[q8s_t1, q8s_t2, q8s_t3]),
    };
    let wide: WideKernel = match w.format {
        PackedFormat::Q4 => q4_wide,
        PackedFormat::Q8 => q8_wide,
        PackedFormat::Q4Min => q4m_wide,
        PackedFormat::Q8Min => q8m_wide,
        PackedFormat::Q8Sub16 => q8s_wide,
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
// Packed matmul without `sdot` (A72/A53-class cores)

/// Packed matmul without the dot-product extension: per 4 activation quants broadcast over the 4
/// rows, `smull`/`smlal` pairs of int8 products into int16 (two products of |16 q| <= 128 and
/// |a| <= 127 fit), `sadalp` into int32. One token runs 4 groups per pass (sharing the
/// broadcasts), several run 1 group x 4 tokens (sharing the unpacked weights).
pub fn matmul(w: &PackedMatrix<'_>, groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]) {
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    // SAFETY: NEON is part of the aarch64 baseline (every arm).
    unsafe {
        match w.format {
            PackedFormat::Q4 => matmul_neon::<FMT_Q4>(w, groups, acts, outs, n),
            PackedFormat::Q4Min => matmul_neon::<FMT_Q4MIN>(w, groups, acts, outs, n),
            PackedFormat::Q8 => matmul_neon::<FMT_Q8>(w, groups, acts, outs, n),
            PackedFormat::Q8Min => matmul_neon::<FMT_Q8MIN>(w, groups, acts, outs, n),
            PackedFormat::Q8Sub16 => matmul_neon::<FMT_Q8SUB16>(w, groups, acts, outs, n),
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
// Small safe helpers

#[target_feature(enable = "neon")]
#[inline]
fn ld_s8x16(b: &[u8]) -> int8x16_t {
    let b: &[u8; 16] = b[..16].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `b`.
    unsafe { vld1q_s8(b.as_ptr().cast()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn ld_i8x16(b: &[i8]) -> int8x16_t {
    let b: &[i8; 16] = b[..16].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `b`.
    unsafe { vld1q_s8(b.as_ptr()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn ld_f32x4(x: &[f32]) -> float32x4_t {
    let x: &[f32; 4] = x[..4].try_into().unwrap();
    // SAFETY: reads the 4 floats of `x`.
    unsafe { vld1q_f32(x.as_ptr()) }
}

/// 16 floats as 4 vectors.
#[target_feature(enable = "neon")]
#[inline]
fn ld_f32x16(x: &[f32]) -> [float32x4_t; 4] {
    let x: &[f32; 16] = x[..16].try_into().unwrap();
    // SAFETY: reads the 16 floats of `x`.
    let r = unsafe { vld1q_f32_x4(x.as_ptr()) };
    [r.0, r.1, r.2, r.3]
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f32x16(x: &mut [f32], v: [float32x4_t; 4]) {
    let x: &mut [f32; 16] = (&mut x[..16]).try_into().unwrap();
    // SAFETY: writes the 16 floats of `x`.
    unsafe { vst1q_f32_x4(x.as_mut_ptr(), float32x4x4_t(v[0], v[1], v[2], v[3])) }
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f32x4(x: &mut [f32], v: float32x4_t) {
    let x: &mut [f32; 4] = (&mut x[..4]).try_into().unwrap();
    // SAFETY: writes the 4 floats of `x`.
    unsafe { vst1q_f32(x.as_mut_ptr(), v) }
}

/// 8 f16 values (`F16Le`s or raw little-endian bytes) as raw bits.
#[target_feature(enable = "neon")]
#[inline]
fn ld_f16x8(x: &[F16Le]) -> uint16x8_t {
    let x: &[F16Le; 8] = x[..8].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `x` (ld1 has no alignment requirement).
    unsafe { vld1q_u16(x.as_ptr().cast()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f16x8(x: &mut [F16Le], v: uint16x8_t) {
    let x: &mut [F16Le; 8] = (&mut x[..8]).try_into().unwrap();
    // SAFETY: writes the 16 bytes of `x`.
    unsafe { vst1q_u16(x.as_mut_ptr().cast(), v) }
}

/// Widens 4 f16 (8 little-endian bytes) to f32.
#[target_feature(enable = "neon")]
#[inline]
fn f16x4_to_f32(b: &[u8]) -> float32x4_t {
    let b: &[u8; 8] = b[..8].try_into().unwrap();
    // SAFETY: reads the 8 bytes of `b`.
    let h = unsafe { vld1_u16(b.as_ptr().cast()) };
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl is base AdvSIMD).
    unsafe {
        asm!("fcvtl {r:v}.4s, {h:v}.4h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Widens the low 4 of 8 f16 (raw bits) to f32.
#[inline(always)]
fn f16_lo(h: uint16x8_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl is base AdvSIMD).
    unsafe {
        asm!("fcvtl {r:v}.4s, {h:v}.4h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Widens the high 4 of 8 f16 (raw bits) to f32.
#[inline(always)]
fn f16_hi(h: uint16x8_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl2 is base AdvSIMD).
    unsafe {
        asm!("fcvtl2 {r:v}.4s, {h:v}.8h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Rounds 8 f32 to f16 (nearest even, as `F16Le::from_f32`), as raw bits.
#[inline(always)]
fn f16_narrow(lo: float32x4_t, hi: float32x4_t) -> uint16x8_t {
    let r: uint16x8_t;
    // SAFETY: register-only conversion (fcvtn/fcvtn2 are base AdvSIMD).
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {lo:v}.4s",
            "fcvtn2 {r:v}.8h, {hi:v}.4s",
            r = out(vreg) r, lo = in(vreg) lo, hi = in(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    r
}

/// Rounds 4 f32 to the nearest f16 value, kept as f32.
#[inline(always)]
fn f16_round4(x: float32x4_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversions (base AdvSIMD).
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {x:v}.4s",
            "fcvtl {r:v}.4s, {r:v}.4h",
            r = out(vreg) r, x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    r
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

// ---------------------------------------------------------------------------------------------
// RMS norm, SwiGLU

/// RMS norm, bit-identical to `reference::rms_norm_ref` (squares in f32, summed in f64 in order).
pub fn rms_norm(x: &[f32], out: &mut [f32], eps: f32) {
    debug_assert_eq!(x.len(), out.len());
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { rms_norm_neon(x, out, eps) }
}

#[target_feature(enable = "neon")]
fn rms_norm_neon(x: &[f32], out: &mut [f32], eps: f32) {
    let mut sum = 0f64;
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for v in [ld_f32x4(c), ld_f32x4(&c[4..])] {
            let sq = vmulq_f32(v, v);
            let (lo, hi) = (vcvt_f64_f32(vget_low_f32(sq)), vcvt_high_f64_f32(sq));
            sum += vgetq_lane_f64::<0>(lo);
            sum += vgetq_lane_f64::<1>(lo);
            sum += vgetq_lane_f64::<0>(hi);
            sum += vgetq_lane_f64::<1>(hi);
        }
    }
    for &v in tail {
        sum += f64::from(v * v);
    }
    let mean = (sum / x.len().max(1) as f64) as f32;
    let scale = 1.0 / libm::sqrtf(mean + eps);
    let n = x.len().min(out.len());
    let whole = n - n % 16;
    for (o, x) in out[..whole].chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        st_f32x16(o, ld_f32x16(x).map(|v| vmulq_n_f32(v, scale)));
    }
    for (o, &v) in out[whole..n].iter_mut().zip(&x[whole..n]) {
        *o = v * scale;
    }
}

/// `silu(gate) * up`, bit-identical to `reference::swiglu_ref`: ggml's exp polynomial with the
/// same fused steps and an exact 2^n scale; chunks with an input outside `|g| <= 86.5` (where
/// 2^n could leave the normal range) or a NaN take the scalar twin.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { swiglu_neon(gate, up, out) }
}

#[target_feature(enable = "neon")]
fn swiglu_neon(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let whole = n - n % 16;
    swiglu_chunks(&gate[..whole], &up[..whole], &mut out[..whole]);
    if whole < n {
        // The tail padded to 16 lanes; every lane is computed on its own.
        let (mut g, mut u, mut o) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        g[..n - whole].copy_from_slice(&gate[whole..n]);
        u[..n - whole].copy_from_slice(&up[whole..n]);
        swiglu_chunks(&g, &u, &mut o);
        out[whole..n].copy_from_slice(&o[..n - whole]);
    }
}

/// The constants of `reference::ggml_expf`, and the fast-path bound.
struct ExpConsts {
    shift: float32x4_t,
    log2e: float32x4_t,
    ln2_hi: float32x4_t,
    ln2_lo: float32x4_t,
    c: [float32x4_t; 5],
    one: float32x4_t,
    bound: float32x4_t,
}

/// SwiGLU over whole chunks of 16.
#[target_feature(enable = "neon")]
fn swiglu_chunks(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let k = |bits: u32| vdupq_n_f32(f32::from_bits(bits));
    let e = ExpConsts {
        shift: k(0x4b40_0000),
        log2e: k(0x3fb8_aa3b),
        ln2_hi: k(0x3f31_7200),
        ln2_lo: k(0x35bf_be8e),
        c: [k(0x3f7f_fff6), k(0x3eff_fedb), k(0x3e2a_af33), k(0x3d2b_9f17), k(0x3c07_2010)],
        one: vdupq_n_f32(1.0),
        // |g| <= 86.5 keeps |n| <= 125: j * 2^n stays normal, so adding n to j's exponent is exact.
        bound: vdupq_n_f32(86.5),
    };
    // Every chunk on the fast path (no calls in the loop: the constants stay in registers), then
    // the rare chunks with an input outside the bound again through the twin.
    let mut all = vdupq_n_u32(u32::MAX);
    for ((o, g), u) in out.chunks_exact_mut(16).zip(gate.chunks_exact(16)).zip(up.chunks_exact(16)) {
        let (gv, uv) = (ld_f32x16(g), ld_f32x16(u));
        let ok = vandq_u32(
            vandq_u32(vcaleq_f32(gv[0], e.bound), vcaleq_f32(gv[1], e.bound)),
            vandq_u32(vcaleq_f32(gv[2], e.bound), vcaleq_f32(gv[3], e.bound)),
        );
        all = vandq_u32(all, ok);
        st_f32x16(o, [0, 1, 2, 3].map(|i| silu_mul(&e, gv[i], uv[i])));
    }
    if vminvq_u32(all) == 0 {
        for ((o, g), u) in out.chunks_exact_mut(16).zip(gate.chunks_exact(16)).zip(up.chunks_exact(16)) {
            if g.iter().any(|g| g.is_nan() || g.abs() > 86.5) {
                swiglu_ref(g, u, o);
            }
        }
    }
}

/// `silu(g) * u` for 4 lanes with `|g| <= 86.5`: the steps of `reference::ggml_expf` (fused where
/// it uses fmaf) for `exp(-g)`.
#[target_feature(enable = "neon")]
#[inline]
fn silu_mul(e: &ExpConsts, g: float32x4_t, u: float32x4_t) -> float32x4_t {
    let x = vnegq_f32(g);
    let z = vfmaq_f32(e.shift, x, e.log2e);
    let n = vsubq_f32(z, e.shift);
    let b = vfmsq_f32(vfmsq_f32(x, n, e.ln2_hi), n, e.ln2_lo);
    let uu = vmulq_f32(b, b);
    let p = vfmaq_f32(e.c[3], e.c[4], b);
    let q = vfmaq_f32(e.c[1], e.c[2], b);
    let r = vfmaq_f32(e.one, e.c[0], b);
    let j = vfmaq_f32(r, vfmaq_f32(q, p, uu), uu);
    // z = 1.5 * 2^23 + n, so z's bits shifted left by 23 are n << 23: add it to j's exponent.
    let ex = vaddq_u32(vreinterpretq_u32_f32(j), vshlq_n_u32::<23>(vreinterpretq_u32_f32(z)));
    vmulq_f32(vdivq_f32(g, vaddq_f32(e.one, vreinterpretq_f32_u32(ex))), u)
}

// ---------------------------------------------------------------------------------------------
// f32 -> f16 rows

/// `reference::f32_to_f16_ref` 8 values at a time (`fcvtn` rounds to nearest even, like it).
pub fn f32_to_f16(x: &[f32], out: &mut [F16Le]) {
    let n = x.len().min(out.len());
    let n8 = n - n % 8;
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { f32_to_f16_neon(&x[..n8], &mut out[..n8]) };
    f32_to_f16_ref(&x[n8..n], &mut out[n8..n]);
}

#[target_feature(enable = "neon")]
fn f32_to_f16_neon(x: &[f32], out: &mut [F16Le]) {
    for (x, o) in x.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
        st_f16x8(o, f16_narrow(ld_f32x4(x), ld_f32x4(&x[4..])));
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE

/// `reference::rope_rotate_ref` four pairs at a time (the same products and sums, unfused).
pub fn rope_rotate(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    if sin.len() != half || x.len() < 2 * half || out.len() != x.len() {
        return rope_rotate_ref(x, out, cos, sin, neox);
    }
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { rope_rotate_neon(x, out, cos, sin, neox) }
}

#[target_feature(enable = "neon")]
fn rope_rotate_neon(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    let n4 = half - half % 4;
    for i in (0..n4).step_by(4) {
        let (c, s) = (ld_f32x4(&cos[i..]), ld_f32x4(&sin[i..]));
        if neox {
            let (x0, x1) = (ld_f32x4(&x[i..]), ld_f32x4(&x[half + i..]));
            st_f32x4(&mut out[i..], vsubq_f32(vmulq_f32(x0, c), vmulq_f32(x1, s)));
            st_f32x4(&mut out[half + i..], vaddq_f32(vmulq_f32(x0, s), vmulq_f32(x1, c)));
        } else {
            let xs: &[f32; 8] = x[2 * i..2 * i + 8].try_into().unwrap();
            // SAFETY: reads the 8 floats of `xs`.
            let v = unsafe { vld2q_f32(xs.as_ptr()) };
            let r = float32x4x2_t(
                vsubq_f32(vmulq_f32(v.0, c), vmulq_f32(v.1, s)),
                vaddq_f32(vmulq_f32(v.0, s), vmulq_f32(v.1, c)),
            );
            let o: &mut [f32; 8] = (&mut out[2 * i..2 * i + 8]).try_into().unwrap();
            // SAFETY: writes the 8 floats of `o`.
            unsafe { vst2q_f32(o.as_mut_ptr(), r) };
        }
    }
    for i in n4..half {
        let (c, s) = (cos[i], sin[i]);
        let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (x[a], x[b]);
        out[a] = x0 * c - x1 * s;
        out[b] = x0 * s + x1 * c;
    }
    out[2 * half..].copy_from_slice(&x[2 * half..]);
}

// ---------------------------------------------------------------------------------------------
// Flash attention

/// Longest query/value row of the FEAT_FP16 kernels (longer ones take the twin).
const MAX_HEAD: usize = 512;

/// Keys per chunk of the kernels' passes.
const KEY_CHUNK: usize = 32;

/// One query row of flash attention over an f16 KV cache: `reference::flash_attn_row_f32dot_ref`'s
/// results, bit for bit (the reference's steps, the key dot summed in f32 in ggml's x86 order):
/// [`flash_attn_rows`] of one row.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    let (dk, dv) = (q.len(), out.len());
    if !f32dot_fits(dk, dv) || q16.len() < dk || acc16.len() < dv {
        return flash_attn_row_f32dot_ref(q, q16, keys, key, value, scale, acc16, out);
    }
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { flash_attn_rows_f32dot::<1>(&[q], q16, keys, key, value, scale, acc16, &mut [out]) }
}

/// Several query rows over the same keys (the query heads of one KV head):
/// `reference::flash_attn_rows_f32dot_ref`'s results, bit for bit (each row's is
/// [`flash_attn_row`]'s), each key and value row loaded and widened once for all rows.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    let n = qs.len().min(outs.len());
    if n == 0 {
        return;
    }
    let (dk, dv) = (qs[0].len(), outs[0].len());
    let fits = n <= FLASH_ROWS
        && f32dot_fits(dk, dv)
        && q16.len() >= n * dk
        && acc16.len() >= n * dv
        && qs[..n].iter().all(|q| q.len() == dk)
        && outs[..n].iter().all(|o| o.len() == dv);
    if !fits {
        return flash_attn_rows_f32dot_ref(qs, q16, keys, key, value, scale, acc16, outs);
    }
    let (qs, outs) = (&qs[..n], &mut outs[..n]);
    // SAFETY: NEON is part of the aarch64 baseline (every arm).
    unsafe {
        match n {
            1 => flash_attn_rows_f32dot::<1>(qs, q16, keys, key, value, scale, acc16, outs),
            2 => flash_attn_rows_f32dot::<2>(qs, q16, keys, key, value, scale, acc16, outs),
            3 => flash_attn_rows_f32dot::<3>(qs, q16, keys, key, value, scale, acc16, outs),
            _ => flash_attn_rows_f32dot::<4>(qs, q16, keys, key, value, scale, acc16, outs),
        }
    }
}

/// `libm::expf` for 4 lanes (the same FreeBSD steps in the same order, the final `scalbnf` as an
/// exponent add), exact on the lanes of the returned mask: `-86 <= x <= 0`, where `2^k` keeps the
/// result normal, and `x <= -103.972084`, where it is 0.
#[target_feature(enable = "neon")]
#[inline]
fn expf4(x: float32x4_t) -> (float32x4_t, uint32x4_t) {
    const INV_LN2: f32 = f32::from_bits(0x3fb8_aa3b);
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    const P1: f32 = 1.666_662_5e-1;
    const P2: f32 = -2.766_733_3e-3;
    let one = vdupq_n_f32(1.0);
    let ax = vreinterpretq_u32_f32(vabsq_f32(x));
    // |x| > 1.5 ln2: k = trunc(x / ln2 - 0.5); 0.5 ln2 < |x| <= 1.5 ln2: k = -1; below: k = 0.
    let ka = vcvtq_s32_f32(vaddq_f32(vmulq_n_f32(x, INV_LN2), vdupq_n_f32(-0.5)));
    let k = vbslq_s32(vcgtq_u32(ax, vdupq_n_u32(0x3f85_1592)), ka, vdupq_n_s32(-1));
    let k = vandq_s32(k, vreinterpretq_s32_u32(vcgtq_u32(ax, vdupq_n_u32(0x3eb1_7218))));
    let kf = vcvtq_f32_s32(k);
    let hi = vsubq_f32(x, vmulq_n_f32(kf, LN2_HI));
    let lo = vmulq_n_f32(kf, LN2_LO);
    let r = vsubq_f32(hi, lo);
    let rr = vmulq_f32(r, r);
    let c = vsubq_f32(r, vmulq_f32(rr, vaddq_f32(vdupq_n_f32(P1), vmulq_n_f32(rr, P2))));
    let y = vdivq_f32(vmulq_f32(r, c), vsubq_f32(vdupq_n_f32(2.0), c));
    let y = vaddq_f32(one, vaddq_f32(vsubq_f32(y, lo), hi));
    let y = vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(y), vshlq_n_s32::<23>(k)));
    // |x| <= 2^-14: 1 + x; x <= -103.972084 (-inf included): 0.
    let y = vbslq_f32(vcleq_u32(ax, vdupq_n_u32(0x3900_0000)), vaddq_f32(one, x), y);
    let zero = vcgeq_u32(ax, vdupq_n_u32(0x42cf_f1b5));
    let y = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), zero));
    (y, vandq_u32(vclezq_f32(x), vorrq_u32(vcaleq_f32(x, vdupq_n_f32(86.0)), zero)))
}

// ---------------------------------------------------------------------------------------------
// Flash attention with ggml's x86 key dot order

/// Longest head of the [`flash_attn_rows_f32dot`] kernels (their packed queries' buffer).
const DOT_HEAD: usize = 256;

/// Whether [`flash_attn_rows_f32dot`] takes these head sizes (the other shapes keep the f64
/// kernels).
fn f32dot_fits(dk: usize, dv: usize) -> bool {
    dk > 0 && dv > 0 && dk <= DOT_HEAD && dv <= MAX_HEAD && dk % 8 == 0 && dv % 8 == 0
}

/// Flash attention of `R` query rows over the same keys with the key dots summed in f32 in
/// ggml's x86 order (`reference::flash_attn_row_f32dot_ref`'s results, bit for bit), in chunks of
/// keys and three passes per chunk: the scores of all rows (`asm!`, each key loaded and widened
/// once), the softmax steps of all rows at once per key (the rows in the lanes, rows past `R`
/// repeating one), the value updates (`asm!`, each value widened once, 32 or 8 dimensions of every
/// row's f16 accumulator in registers, rounded to f16 after every key as the reference does).
/// Checked shapes: [`f32dot_fits`], `R` rows of `dk` and `dv`, scratch long enough.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
fn flash_attn_rows_f32dot<'k, const R: usize>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    let (dk, dv) = (qs[0].len(), outs[0].len());
    let pieces = dk.div_ceil(32);
    // The queries rounded to f16 and widened back, packed in the kernels' order: per 32
    // dimensions, per 16 of them, row 0's, row 1's, ...; zero past `dk`.
    let mut qp = [[0f32; DOT_HEAD]; R];
    let qp = qp.as_flattened_mut();
    for (r, q) in qs.iter().enumerate() {
        let h = &mut q16[r * dk..(r + 1) * dk];
        for (i, (q, h)) in q.chunks_exact(8).zip(h.chunks_exact_mut(8)).enumerate() {
            let x = f16_narrow(ld_f32x4(q), ld_f32x4(&q[4..]));
            st_f16x8(h, x);
            let at = i / 4 * 32 * R + i % 4 / 2 * 16 * R + r * 16 + i % 2 * 8;
            st_f32x4(&mut qp[at..], f16_lo(x));
            st_f32x4(&mut qp[at + 4..], f16_hi(x));
        }
    }
    let acc16 = &mut acc16[..R * dv];
    acc16.fill(F16Le::from_bits(0));
    // Keys whose size is not a multiple of 32 are copied into zeroed rows (the twin's padding).
    let mut kpad = None;
    let (mut max, mut sum) = (vdupq_n_f32(f32::NEG_INFINITY), vdupq_n_f32(0.0));
    // Per chunk: the key and value rows, the scores, the weights and raises (set before use).
    let (mut krows, mut vrows) =
        ([core::ptr::null::<F16Le>(); KEY_CHUNK], [core::ptr::null::<F16Le>(); KEY_CHUNK]);
    let mut s = [[0f32; 4]; KEY_CHUNK];
    let (mut w, mut raise) = ([[0f32; 8]; KEY_CHUNK], [0u32; KEY_CHUNK]);
    let mut j = keys.start;
    while j < keys.end {
        let m = (keys.end - j).min(KEY_CHUNK);
        if dk % 32 == 0 {
            for (i, (k, v)) in krows[..m].iter_mut().zip(&mut vrows[..m]).enumerate() {
                (*k, *v) = (key(j + i)[..dk].as_ptr(), value(j + i)[..dv].as_ptr());
            }
        } else {
            let pad = kpad.get_or_insert([[F16Le::from_bits(0); DOT_HEAD]; KEY_CHUNK]);
            for (i, ((k, v), p)) in krows[..m].iter_mut().zip(&mut vrows[..m]).zip(pad.iter_mut()).enumerate()
            {
                p[..dk].copy_from_slice(&key(j + i)[..dk]);
                (*k, *v) = (p.as_ptr(), value(j + i)[..dv].as_ptr());
            }
        }
        let rows = &krows[..m];
        let (q, o) = (qp.as_ptr(), s.as_mut_ptr());
        // SAFETY: in every arm, `rows` point at `32 pieces` f16 each (padded above); the kernels read
        // the `32 R pieces` packed floats of `qp` (a 2-row kernel rows 0, 1 or 2, 3 of each 16
        // dimensions, skipping the other two: 128 bytes) and write `m` entries of `s` (2 lanes
        // each from byte 0 or 8 for the 2-row kernel).
        unsafe {
            match R {
                1 => dscores1(q, pieces, rows, scale, o, 0),
                2 => dscores2(q, pieces, rows, scale, o, 0),
                3 => dscores3(q, pieces, rows, scale, o, 0),
                _ => {
                    dscores_pair(q, pieces, rows, scale, o, 128);
                    dscores_pair(q.add(32), pieces, rows, scale, o.cast::<f32>().add(2).cast(), 128);
                }
            }
        }
        // Per key, the rows in the lanes: the reference's softmax step, the weights (`vs` in
        // lanes 0..4, `ms` in 4..8) and which rows raise their maximum (bit `r` for row `r`).
        softmax_rows(&s[..m], &mut max, &mut sum, &mut w, &mut raise);
        let mut d = 0;
        while d < dv {
            let wide = dv - d >= 32;
            // SAFETY: in every arm, `vrows[..m]` point at `dv` f16 each, `d + 32` (wide) or `d + 8`
            // at most `dv`, `acc16` holds `R dv`.
            unsafe {
                let (a, v) = (acc16.as_mut_ptr().add(d), &vrows[..m]);
                match (R, wide) {
                    (1, true) => dvalues1w(a, dv, d, v, &w, &raise),
                    (1, false) => dvalues1n(a, dv, d, v, &w, &raise),
                    (2, true) => dvalues2w(a, dv, d, v, &w, &raise),
                    (2, false) => dvalues2n(a, dv, d, v, &w, &raise),
                    (3, true) => dvalues3w(a, dv, d, v, &w, &raise),
                    (3, false) => dvalues3n(a, dv, d, v, &w, &raise),
                    (_, true) => dvalues4w(a, dv, d, v, &w, &raise),
                    (_, false) => dvalues4n(a, dv, d, v, &w, &raise),
                }
            }
            d += if wide { 32 } else { 8 };
        }
        j += m;
    }
    let mut sums = [0f32; 4];
    st_f32x4(&mut sums, sum);
    for (r, out) in outs.iter_mut().enumerate() {
        let inv = if sums[r] == 0.0 { 0.0 } else { 1.0 / sums[r] };
        for (o, a) in out.chunks_exact_mut(8).zip(acc16[r * dv..(r + 1) * dv].chunks_exact(8)) {
            let h = ld_f16x8(a);
            st_f32x4(o, vmulq_n_f32(f16_lo(h), inv));
            st_f32x4(&mut o[4..], vmulq_n_f32(f16_hi(h), inv));
        }
    }
}

/// The reference's softmax steps for a chunk of keys, the rows in the lanes (`s[i]`: key `i`'s
/// scores): per key, the weights (`vs` in lanes 0..4 of `w[i]`, `ms` in 4..8) and which rows raise
/// their maximum (`raise[i]`: bit `r` for row `r`); `max` and `sum` carried over. A first pass
/// uses [`expf4`] alone (no calls, so its constants stay in registers); if any lane fell outside
/// its exact range the chunk is redone with `libm::expf` there.
#[target_feature(enable = "neon")]
#[inline(never)]
fn softmax_rows(
    s: &[[f32; 4]],
    max: &mut float32x4_t,
    sum: &mut float32x4_t,
    w: &mut [[f32; 8]; KEY_CHUNK],
    raise: &mut [u32; KEY_CHUNK],
) {
    let (mx, total) = (*max, *sum);
    if !softmax_pass::<false>(s, max, sum, w, raise) {
        (*max, *sum) = (mx, total);
        softmax_pass::<true>(s, max, sum, w, raise);
    }
}

/// [`softmax_rows`]' steps; `EXACT`: lanes outside [`expf4`]'s exact range take `libm::expf`,
/// else they are left wrong and `false` is returned.
#[target_feature(enable = "neon")]
#[inline]
fn softmax_pass<const EXACT: bool>(
    s: &[[f32; 4]],
    max: &mut float32x4_t,
    sum: &mut float32x4_t,
    w: &mut [[f32; 8]; KEY_CHUNK],
    raise: &mut [u32; KEY_CHUNK],
) -> bool {
    let one = vdupq_n_f32(1.0);
    // SAFETY: reads the 4 lanes of the array.
    let bits = unsafe { vld1q_u32([1u32, 2, 4, 8].as_ptr()) };
    let (mut mx, mut total) = (*max, *sum);
    let mut all = vdupq_n_u32(u32::MAX);
    for ((s, w), raise) in s.iter().zip(w.iter_mut()).zip(raise.iter_mut()) {
        let s = ld_f32x4(s);
        let up = vcgtq_f32(s, mx);
        let x = vbslq_f32(up, vsubq_f32(mx, s), vsubq_f32(s, mx));
        mx = vbslq_f32(up, s, mx);
        let (mut e, ok) = expf4(x);
        if EXACT {
            if vminvq_u32(ok) == 0 {
                let mut a = [0f32; 4];
                st_f32x4(&mut a, x);
                e = ld_f32x4(&a.map(libm::expf));
            }
        } else {
            all = vandq_u32(all, ok);
        }
        let (ms, vs) = (vbslq_f32(up, e, one), vbslq_f32(up, one, e));
        total = vaddq_f32(vmulq_f32(total, ms), vs);
        st_f32x4(w, vs);
        st_f32x4(&mut w[4..], ms);
        *raise = vaddvq_u32(vandq_u32(up, bits));
    }
    (*max, *sum) = (mx, total);
    vminvq_u32(all) != 0
}

/// 16 dimensions of one query row (`{qp}`, f32) times the key's (v0-v3, widened), into the row's
/// accumulators `v$l0, v$h0` (8 lanes of one ggml accumulator) and `v$l1, v$h1` (the next).
#[rustfmt::skip]
macro_rules! drow16 { ($op:literal, $l0:literal, $h0:literal, $l1:literal, $h1:literal) => { concat!(
    "ld1 {{v4.4s, v5.4s, v6.4s, v7.4s}}, [{qp}], #64\n",
    $op, " v", $l0, ".4s, v0.4s, v4.4s\n",   $op, " v", $h0, ".4s, v1.4s, v5.4s\n",
    $op, " v", $l1, ".4s, v2.4s, v6.4s\n",   $op, " v", $h1, ".4s, v3.4s, v7.4s\n",
) } }

/// 16 dimensions of the key (`{p}`, f16) widened to f32 into v0-v3.
#[rustfmt::skip]
macro_rules! dkey16 { () => { concat!(
    "ld1 {{v0.8h, v1.8h}}, [{p}], #32\n",
    "fcvtl2 v3.4s, v1.8h\n",     "fcvtl v2.4s, v1.4h\n",
    "fcvtl2 v1.4s, v0.8h\n",     "fcvtl v0.4s, v0.4h\n",
) } }

/// A row's four 8-lane accumulators (`v$a..`: lo, hi of accumulator 0, 1, 2, 3) folded as ggml's
/// x86 reduction: `x = (a0 + a2) + (a1 + a3)`, `t[i] = x[i] + x[i + 4]`, into `v$a0.4s`.
#[rustfmt::skip]
macro_rules! dfold { ($a0:literal, $b0:literal, $a1:literal, $b1:literal,
                      $a2:literal, $b2:literal, $a3:literal, $b3:literal) => { concat!(
    "fadd v", $a0, ".4s, v", $a0, ".4s, v", $a2, ".4s\n",
    "fadd v", $b0, ".4s, v", $b0, ".4s, v", $b2, ".4s\n",
    "fadd v", $a1, ".4s, v", $a1, ".4s, v", $a3, ".4s\n",
    "fadd v", $b1, ".4s, v", $b1, ".4s, v", $b3, ".4s\n",
    "fadd v", $a0, ".4s, v", $a0, ".4s, v", $a1, ".4s\n",
    "fadd v", $b0, ".4s, v", $b0, ".4s, v", $b1, ".4s\n",
    "fadd v", $a0, ".4s, v", $a0, ".4s, v", $b0, ".4s\n",
) } }

/// Defines a scores kernel for `R` rows (at most 3: 8 accumulator registers a row): per key, each
/// 32 dimensions as two steps of 16 (accumulators 0, 1 then 2, 3: dimension chunk `c` of 8 into
/// ggml's accumulator `c % 4`; `fmul` for the first 32 dimensions, then `fmla`), the rows folded
/// ([`dfold`]), each row's four lanes summed as `(t0 + t1) + (t2 + t3)` by `faddp`, times the
/// scale, stored (`$store`: a whole 4-lane entry, or 2 lanes at `$lane_off` bytes).
#[rustfmt::skip]
macro_rules! dscores_kernel {
    ($name:ident, $r:literal, [$( ($a0:literal, $b0:literal, $a1:literal, $b1:literal,
                                   $a2:literal, $b2:literal, $a3:literal, $b3:literal) ),+],
     [$( $fin:literal ),+], $store:literal) => {
        /// # Safety
        /// Each row points at `32 pieces` f16 values (`pieces > 0`, `rows.len() > 0`); from `qp`,
        /// per 16 dimensions, `16 R` floats are read, then `stride` bytes skipped; `s` has room for
        /// `rows.len()` entries of 16 bytes.
        #[target_feature(enable = "neon")]
        unsafe fn $name(qp: *const f32, pieces: usize, rows: &[*const F16Le], scale: f32, s: *mut [f32; 4],
                        stride: usize) {
            debug_assert!(!rows.is_empty() && pieces > 0);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "mov {qp}, {qd}",
                    dkey16!(),
                    $( drow16!("fmul", $a0, $b0, $a1, $b1), )+
                    "add {qp}, {qp}, {stride}",
                    dkey16!(),
                    $( drow16!("fmul", $a2, $b2, $a3, $b3), )+
                    "add {qp}, {qp}, {stride}",
                    "subs {c}, {pieces}, #1",
                    "b.eq 4f",
                    "3:",
                    dkey16!(),
                    $( drow16!("fmla", $a0, $b0, $a1, $b1), )+
                    "add {qp}, {qp}, {stride}",
                    dkey16!(),
                    $( drow16!("fmla", $a2, $b2, $a3, $b3), )+
                    "add {qp}, {qp}, {stride}",
                    "subs {c}, {c}, #1",
                    "b.ne 3b",
                    "4:",
                    $( dfold!($a0, $b0, $a1, $b1, $a2, $b2, $a3, $b3), )+
                    $( $fin, )+
                    "dup v4.4s, {sc:w}",
                    "fmul v8.4s, v8.4s, v4.4s",
                    $store,
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    out = inout(reg) s => _,
                    qd = in(reg) qp,
                    pieces = in(reg) pieces,
                    stride = in(reg) stride,
                    sc = in(reg) scale.to_bits(),
                    qp = out(reg) _,
                    p = out(reg) _,
                    c = out(reg) _,
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

dscores_kernel!(
    dscores1,
    1,
    [("8", "9", "10", "11", "12", "13", "14", "15")],
    ["faddp v8.4s, v8.4s, v8.4s", "faddp v8.4s, v8.4s, v8.4s"],
    "str q8, [{out}], #16"
);
dscores_kernel!(
    dscores2,
    2,
    [("8", "9", "10", "11", "12", "13", "14", "15"), ("16", "17", "18", "19", "20", "21", "22", "23")],
    ["faddp v8.4s, v8.4s, v16.4s", "faddp v8.4s, v8.4s, v8.4s"],
    "str q8, [{out}], #16"
);
dscores_kernel!(
    dscores3,
    3,
    [
        ("8", "9", "10", "11", "12", "13", "14", "15"),
        ("16", "17", "18", "19", "20", "21", "22", "23"),
        ("24", "25", "26", "27", "28", "29", "30", "31")
    ],
    ["faddp v8.4s, v8.4s, v16.4s", "faddp v24.4s, v24.4s, v24.4s", "faddp v8.4s, v8.4s, v24.4s"],
    "str q8, [{out}], #16"
);
dscores_kernel!(
    dscores_pair,
    2,
    [("8", "9", "10", "11", "12", "13", "14", "15"), ("16", "17", "18", "19", "20", "21", "22", "23")],
    ["faddp v8.4s, v8.4s, v16.4s", "faddp v8.4s, v8.4s, v8.4s"],
    "str d8, [{out}]\nadd {out}, {out}, #16"
);

/// `acc = f16(fma(v, vs, f32(acc)))` for the f16 accumulator `v$a` (8 lanes), the value widened in
/// `v$lo`, `v$hi` and the row's weight in lane `$l` of v4 (v0, v1 scratch).
#[rustfmt::skip]
macro_rules! dmad8 { ($a:literal, $lo:literal, $hi:literal, $l:literal) => { concat!(
    "fcvtl v0.4s, v", $a, ".4h\n",               "fcvtl2 v1.4s, v", $a, ".8h\n",
    "fmla v0.4s, v", $lo, ".4s, v4.s[", $l, "]\n", "fmla v1.4s, v", $hi, ".4s, v4.s[", $l, "]\n",
    "fcvtn v", $a, ".4h, v0.4s\n",               "fcvtn2 v", $a, ".8h, v1.4s\n",
) } }

/// `acc = f16(f32(acc) ms)` for the f16 accumulator `v$a`, the row's `ms` in lane `$l` of v5.
#[rustfmt::skip]
macro_rules! dscale8 { ($a:literal, $l:literal) => { concat!(
    "fcvtl v0.4s, v", $a, ".4h\n",               "fcvtl2 v1.4s, v", $a, ".8h\n",
    "fmul v0.4s, v0.4s, v5.s[", $l, "]\n",       "fmul v1.4s, v1.4s, v5.s[", $l, "]\n",
    "fcvtn v", $a, ".4h, v0.4s\n",               "fcvtn2 v", $a, ".8h, v1.4s\n",
) } }

/// Defines the value-update kernel for `R` rows and 32 dimensions (`w`: row `r`'s f16
/// accumulators in 4 registers, the value widened into v6-v13) or 8 (`n`: one register, v6, v7):
/// the accumulators loaded from `acc`, then per key the reference's steps with the weights of
/// all rows (`vs` in lanes 0..4 of v4, `ms` in v5): `acc = f16(acc ms)` for each row that raises
/// its maximum (bit `r` of the key's `raise`), then `acc = f16(fma(v, vs, acc))`; the accumulators
/// stored back.
#[rustfmt::skip]
macro_rules! dvalues_kernel {
    ($name:ident, w, [$( ($l:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        dvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldp q", $a0, ", q", $a1, ", [{t}]\n", "ldp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "stp q", $a0, ", q", $a1, ", [{t}]\n", "stp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            concat!("ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}]\n",
                    "fcvtl v6.4s, v0.4h\n", "fcvtl2 v7.4s, v0.8h\n", "fcvtl v8.4s, v1.4h\n", "fcvtl2 v9.4s, v1.8h\n",
                    "fcvtl v10.4s, v2.4h\n", "fcvtl2 v11.4s, v2.8h\n", "fcvtl v12.4s, v3.4h\n", "fcvtl2 v13.4s, v3.8h\n"),
            concat!($( dmad8!($a0, "6", "7", $l), dmad8!($a1, "8", "9", $l),
                       dmad8!($a2, "10", "11", $l), dmad8!($a3, "12", "13", $l), )+),
            concat!($( "tbz {f:w}, #", $l, ", 7f\n",
                       dscale8!($a0, $l), dscale8!($a1, $l), dscale8!($a2, $l), dscale8!($a3, $l), "7:\n", )+));
    };
    ($name:ident, n, [$( ($l:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        dvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldr q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "str q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            concat!("ldr q2, [{p}]\n", "fcvtl v6.4s, v2.4h\n", "fcvtl2 v7.4s, v2.8h\n"),
            concat!($( dmad8!($a0, "6", "7", $l), )+),
            concat!($( "tbz {f:w}, #", $l, ", 7f\n", dscale8!($a0, $l), "7:\n", )+));
    };
    (@def $name:ident, $load:expr, $store:expr, $vload:expr, $mad:expr, $rescale:expr) => {
        /// # Safety
        /// `acc` points at row 0's accumulators of the slice (`R` rows `dv` f16 apart), each of
        /// `rows` at `dv` f16 values of which `d..` hold the slice; `w` and `raise` have at least
        /// `rows.len() > 0` entries.
        #[target_feature(enable = "neon")]
        unsafe fn $name(
            acc: *mut F16Le,
            dv: usize,
            d: usize,
            rows: &[*const F16Le],
            w: &[[f32; 8]; KEY_CHUNK],
            raise: &[u32; KEY_CHUNK],
        ) {
            debug_assert!(!rows.is_empty() && rows.len() <= KEY_CHUNK);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    $load,
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "ldp q4, q5, [{w}], #32",
                    "ldr {f:w}, [{raise}], #4",
                    "add {p}, {p}, {off}",
                    "cbnz {f:w}, 5f",
                    "3:",
                    $vload,
                    $mad,
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "b 6f",
                    "5:",
                    $rescale,
                    "b 3b",
                    "6:",
                    $store,
                    a = in(reg) acc,
                    t = out(reg) _,
                    stride = in(reg) 2 * dv,
                    off = in(reg) 2 * d,
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    w = inout(reg) w.as_ptr() => _,
                    raise = inout(reg) raise.as_ptr() => _,
                    p = out(reg) _,
                    f = out(reg) _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
                    out("v6") _, out("v7") _, out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _,
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

dvalues_kernel!(dvalues1w, w, [("0", "16", "17", "18", "19")]);
dvalues_kernel!(dvalues1n, n, [("0", "16", "17", "18", "19")]);
dvalues_kernel!(dvalues2w, w, [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23")]);
dvalues_kernel!(dvalues2n, n, [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23")]);
dvalues_kernel!(
    dvalues3w,
    w,
    [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23"), ("2", "24", "25", "26", "27")]
);
dvalues_kernel!(
    dvalues3n,
    n,
    [("0", "16", "17", "18", "19"), ("1", "20", "21", "22", "23"), ("2", "24", "25", "26", "27")]
);
dvalues_kernel!(
    dvalues4w,
    w,
    [
        ("0", "16", "17", "18", "19"),
        ("1", "20", "21", "22", "23"),
        ("2", "24", "25", "26", "27"),
        ("3", "28", "29", "30", "31")
    ]
);
dvalues_kernel!(
    dvalues4n,
    n,
    [
        ("0", "16", "17", "18", "19"),
        ("1", "20", "21", "22", "23"),
        ("2", "24", "25", "26", "27"),
        ("3", "28", "29", "30", "31")
    ]
);

// ---------------------------------------------------------------------------------------------
// Flash attention in FEAT_FP16 arithmetic

/// Flash attention of up to [`FLASH_ROWS`] query rows over the same keys in FEAT_FP16 vector
/// arithmetic (`fmla .8h`), as llama.cpp's aarch64 build computes it:
/// `reference::flash_attn_rows_f16arith_ref`'s results, bit for bit. Shapes the kernels do not
/// take (head sizes not multiples of 8 or past `MAX_HEAD`, ragged rows) go to that twin.
///
/// Runs on the `fp16` path (`KernelPath::NeonFp16`), detected wherever the CPU has dotprod and
/// FEAT_FP16 (Cortex-A76 and A55): the same numerics as llama.cpp on the board. The tests hold it
/// to llama.cpp's aarch64 build (tests/golden/*.arm.greedy.jsonl and *.arm.spread.jsonl, written
/// by `scripts/make_golden.py --arm` and `scripts/golden_spread.py --arm`); its f16 scores and
/// f16-rounded weights move the tiny random MoE models' routing away from the x86 build's
/// (qwen3moe-tiny step 0: a top-5 logit 0.92 off), as llama.cpp's own aarch64 build does. The
/// `dotprod` path keeps the x86 arithmetic.
///
/// # Safety
/// The CPU has FEAT_FP16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon,fp16")]
pub unsafe fn flash_attn_rows_fp16<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    let n = qs.len().min(outs.len());
    if n == 0 {
        return;
    }
    let (dk, dv) = (qs[0].len(), outs[0].len());
    let fits = n <= FLASH_ROWS
        && dk > 0
        && dv > 0
        && dk <= MAX_HEAD
        && dv <= MAX_HEAD
        && dk % 8 == 0
        && dv % 8 == 0
        && q16.len() >= n * dk
        && acc16.len() >= n * dv
        && qs[..n].iter().all(|q| q.len() == dk)
        && outs[..n].iter().all(|o| o.len() == dv);
    if !fits {
        return flash_attn_rows_f16arith_ref(qs, q16, keys, key, value, scale, acc16, outs);
    }
    let (qs, outs) = (&qs[..n], &mut outs[..n]);
    match n {
        1 => fa_fp16::<1>(qs, q16, keys, key, value, scale, acc16, outs),
        2 => fa_fp16::<2>(qs, q16, keys, key, value, scale, acc16, outs),
        3 => fa_fp16::<3>(qs, q16, keys, key, value, scale, acc16, outs),
        _ => fa_fp16::<4>(qs, q16, keys, key, value, scale, acc16, outs),
    }
}

/// One query row of [`flash_attn_rows_fp16`] (`reference::flash_attn_row_f16arith_ref`).
///
/// # Safety
/// The CPU has FEAT_FP16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon,fp16")]
pub unsafe fn flash_attn_row_fp16<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    // SAFETY: the CPU has FEAT_FP16 (this function's contract).
    unsafe { flash_attn_rows_fp16(&[q], q16, keys, key, value, scale, acc16, &mut [out]) }
}

/// [`flash_attn_rows_fp16`] for `R` rows (checked shapes), in chunks of keys and three passes per
/// chunk: the scores of all rows (`asm!`, each key loaded once), the softmax steps of all rows at
/// once per key (the rows in the lanes), the value updates (`asm!`, each value loaded once, 32 or 8
/// dimensions of every row's accumulator in registers).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon,fp16")]
fn fa_fp16<'k, const R: usize>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    let (dk, dv) = (qs[0].len(), outs[0].len());
    let pieces = dk.div_ceil(32);
    // The queries rounded to f16, packed per 32 dimensions (row 0's, row 1's, ...), zero past `dk`.
    let mut qp = [F16Le::from_bits(0); FLASH_ROWS * MAX_HEAD];
    for (r, q) in qs.iter().enumerate() {
        let h = &mut q16[r * dk..(r + 1) * dk];
        for (q, h) in q.chunks_exact(8).zip(h.chunks_exact_mut(8)) {
            st_f16x8(h, f16_narrow(ld_f32x4(q), ld_f32x4(&q[4..])));
        }
        for (c, piece) in h.chunks(32).enumerate() {
            qp[(c * R + r) * 32..][..piece.len()].copy_from_slice(piece);
        }
    }
    let acc16 = &mut acc16[..R * dv];
    acc16.fill(F16Le::from_bits(0));
    // Keys whose size is not a multiple of 32 are copied into zeroed rows (the twin's padding).
    let mut kpad = None;
    let one = vdupq_n_f32(1.0);
    let (mut max, mut sum) = (vdupq_n_f32(f32::NEG_INFINITY), vdupq_n_f32(0.0));
    let mut j = keys.start;
    while j < keys.end {
        let m = (keys.end - j).min(KEY_CHUNK);
        let (mut krows, mut vrows) =
            ([core::ptr::null::<F16Le>(); KEY_CHUNK], [core::ptr::null::<F16Le>(); KEY_CHUNK]);
        if dk % 32 == 0 {
            for (i, (k, v)) in krows[..m].iter_mut().zip(&mut vrows[..m]).enumerate() {
                (*k, *v) = (key(j + i)[..dk].as_ptr(), value(j + i)[..dv].as_ptr());
            }
        } else {
            let pad = kpad.get_or_insert([[F16Le::from_bits(0); MAX_HEAD]; KEY_CHUNK]);
            for (i, ((k, v), p)) in krows[..m].iter_mut().zip(&mut vrows[..m]).zip(pad.iter_mut()).enumerate()
            {
                p[..dk].copy_from_slice(&key(j + i)[..dk]);
                (*k, *v) = (p.as_ptr(), value(j + i)[..dv].as_ptr());
            }
        }
        let mut s = [[0f32; 4]; KEY_CHUNK];
        // SAFETY: in every arm, `krows[..m]` point at `32 pieces` f16 each (padded above), `qp` holds
        // `32 R pieces`, `s` has `m` entries; the CPU has FEAT_FP16 (this function's feature).
        unsafe {
            match R {
                1 => hscores1(&qp, pieces, &krows[..m], scale, &mut s),
                2 => hscores2(&qp, pieces, &krows[..m], scale, &mut s),
                3 => hscores3(&qp, pieces, &krows[..m], scale, &mut s),
                _ => hscores4(&qp, pieces, &krows[..m], scale, &mut s),
            }
        }
        // Per key, the rows in the lanes (rows past `R` repeat a row): the reference's softmax
        // step, the weights rounded to f16 (`vs` in halves 0..4, `ms` in 4..8) and whether any
        // row raises its maximum.
        let (mut w, mut raise) = ([[0u16; 8]; KEY_CHUNK], [0u32; KEY_CHUNK]);
        for ((s, w), raise) in s[..m].iter().zip(&mut w[..m]).zip(&mut raise[..m]) {
            let s = ld_f32x4(s);
            let up = vcgtq_f32(s, max);
            let x = vbslq_f32(up, vsubq_f32(max, s), vsubq_f32(s, max));
            max = vbslq_f32(up, s, max);
            let (mut e, ok) = expf4(x);
            if vminvq_u32(ok) == 0 {
                let mut a = [0f32; 4];
                st_f32x4(&mut a, x);
                let a = a.map(libm::expf);
                e = ld_f32x4(&a);
            }
            let (ms, vs) = (vbslq_f32(up, e, one), vbslq_f32(up, one, e));
            sum = vaddq_f32(vmulq_f32(sum, ms), vs);
            // SAFETY: writes the 8 halves of `w`.
            unsafe { vst1q_u16(w.as_mut_ptr(), f16_narrow(vs, ms)) };
            *raise = vmaxvq_u32(up);
        }
        let mut d = 0;
        while d < dv {
            let wide = dv - d >= 32;
            // SAFETY: in every arm, `vrows[..m]` point at `dv` f16 each, `d + 32` (wide) or `d + 8`
            // at most `dv`, `acc16` holds `R dv`; the CPU has FEAT_FP16.
            unsafe {
                let a = acc16.as_mut_ptr().add(d);
                match (R, wide) {
                    (1, true) => hvalues1w(a, dv, d, &vrows[..m], &w, &raise),
                    (1, false) => hvalues1n(a, dv, d, &vrows[..m], &w, &raise),
                    (2, true) => hvalues2w(a, dv, d, &vrows[..m], &w, &raise),
                    (2, false) => hvalues2n(a, dv, d, &vrows[..m], &w, &raise),
                    (3, true) => hvalues3w(a, dv, d, &vrows[..m], &w, &raise),
                    (3, false) => hvalues3n(a, dv, d, &vrows[..m], &w, &raise),
                    (_, true) => hvalues4w(a, dv, d, &vrows[..m], &w, &raise),
                    (_, false) => hvalues4n(a, dv, d, &vrows[..m], &w, &raise),
                }
            }
            d += if wide { 32 } else { 8 };
        }
        j += m;
    }
    let mut sums = [0f32; 4];
    st_f32x4(&mut sums, sum);
    for (r, out) in outs.iter_mut().enumerate() {
        let inv = if sums[r] == 0.0 { 0.0 } else { 1.0 / sums[r] };
        for (o, a) in out.chunks_exact_mut(8).zip(acc16[r * dv..(r + 1) * dv].chunks_exact(8)) {
            let h = ld_f16x8(a);
            st_f32x4(o, vmulq_n_f32(f16_lo(h), inv));
            st_f32x4(&mut o[4..], vmulq_n_f32(f16_hi(h), inv));
        }
    }
}

/// 32 dimensions of one query row (`{qp}`) times the key's in v0-v3, into the row's f16
/// accumulators `v$a0..v$a3` (`$op`: `fmul` for the first 32, else `fmla`).
#[rustfmt::skip]
macro_rules! hrow32 { ($op:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => { concat!(
    "ld1 {{v4.8h, v5.8h, v6.8h, v7.8h}}, [{qp}], #64\n",
    $op, " v", $a0, ".8h, v0.8h, v4.8h\n",   $op, " v", $a1, ".8h, v1.8h, v5.8h\n",
    $op, " v", $a2, ".8h, v2.8h, v6.8h\n",   $op, " v", $a3, ".8h, v3.8h, v7.8h\n",
) } }

/// A row's accumulators folded as the twin does: `(a0 + a2) + (a1 + a3)` in f16, the halves
/// widened and added (`t[i] = x[i] + x[i + 4]`), into `v$a0.4s`.
#[rustfmt::skip]
macro_rules! hfold { ($a0:literal, $a1:literal, $a2:literal, $a3:literal) => { concat!(
    "fadd v", $a0, ".8h, v", $a0, ".8h, v", $a2, ".8h\n",
    "fadd v", $a1, ".8h, v", $a1, ".8h, v", $a3, ".8h\n",
    "fadd v", $a0, ".8h, v", $a0, ".8h, v", $a1, ".8h\n",
    "fcvtl v", $a1, ".4s, v", $a0, ".4h\n",
    "fcvtl2 v", $a2, ".4s, v", $a0, ".8h\n",
    "fadd v", $a0, ".4s, v", $a1, ".4s, v", $a2, ".4s\n",
) } }

/// Defines the scores kernel for `R` rows: per key, each 32 dimensions loaded once for every row
/// ([`hrow32`], the queries packed per 32 dimensions), the rows folded ([`hfold`]), the four
/// lanes `t` of each row summed pairwise as `(t0 + t1) + (t2 + t3)` by `faddp` (rows past `R`
/// repeat one), times the scale, stored as one 4-lane entry per key.
#[rustfmt::skip]
macro_rules! hscores_kernel {
    ($name:ident, $r:literal, [$( ($a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+],
     [$( $fin:literal ),+]) => {
        /// # Safety
        /// Each row points at `32 pieces` f16 values (`pieces > 0`); `qp` holds `32 R pieces`;
        /// `0 < rows.len() <= s.len()`; the CPU has FEAT_FP16.
        #[target_feature(enable = "neon,fp16")]
        unsafe fn $name(qp: &[F16Le], pieces: usize, rows: &[*const F16Le], scale: f32, s: &mut [[f32; 4]]) {
            debug_assert!(!rows.is_empty() && rows.len() <= s.len() && pieces > 0);
            debug_assert!(qp.len() >= 32 * $r * pieces);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "mov {qp}, {qd}",
                    "ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}], #64",
                    $( hrow32!("fmul", $a0, $a1, $a2, $a3), )+
                    "subs {c}, {pieces}, #1",
                    "b.eq 4f",
                    "3:",
                    "ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}], #64",
                    $( hrow32!("fmla", $a0, $a1, $a2, $a3), )+
                    "subs {c}, {c}, #1",
                    "b.ne 3b",
                    "4:",
                    $( hfold!($a0, $a1, $a2, $a3), )+
                    $( $fin, )+
                    "fmul v16.4s, v16.4s, v8.s[0]",
                    "str q16, [{out}], #16",
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    out = inout(reg) s.as_mut_ptr() => _,
                    qd = in(reg) qp.as_ptr(),
                    pieces = in(reg) pieces,
                    qp = out(reg) _,
                    p = out(reg) _,
                    c = out(reg) _,
                    in("v8") scale,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
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

hscores_kernel!(
    hscores1,
    1,
    [("16", "17", "18", "19")],
    ["faddp v16.4s, v16.4s, v16.4s", "faddp v16.4s, v16.4s, v16.4s"]
);
hscores_kernel!(
    hscores2,
    2,
    [("16", "17", "18", "19"), ("20", "21", "22", "23")],
    ["faddp v16.4s, v16.4s, v20.4s", "faddp v16.4s, v16.4s, v16.4s"]
);
hscores_kernel!(
    hscores3,
    3,
    [("16", "17", "18", "19"), ("20", "21", "22", "23"), ("24", "25", "26", "27")],
    ["faddp v16.4s, v16.4s, v20.4s", "faddp v24.4s, v24.4s, v24.4s", "faddp v16.4s, v16.4s, v24.4s"]
);
hscores_kernel!(
    hscores4,
    4,
    [("16", "17", "18", "19"), ("20", "21", "22", "23"), ("24", "25", "26", "27"), ("28", "29", "30", "31")],
    ["faddp v16.4s, v16.4s, v20.4s", "faddp v24.4s, v24.4s, v28.4s", "faddp v16.4s, v16.4s, v24.4s"]
);

/// Defines the value-update kernel for `R` rows and 32 dimensions (`w`, the accumulators of row `r`
/// in 4 registers) or 8 (`n`, one register): the accumulators loaded from `acc`, then per key a
/// rescale by the `ms` halves (4..8 of the weights) when any row raises its maximum, the
/// `fmla .8h` of the value times the `vs` halves (0..4), and the accumulators stored back.
#[rustfmt::skip]
macro_rules! hvalues_kernel {
    ($name:ident, w, [$( ($lane:literal, $ml:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        hvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldp q", $a0, ", q", $a1, ", [{t}]\n", "ldp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "stp q", $a0, ", q", $a1, ", [{t}]\n", "stp q", $a2, ", q", $a3, ", [{t}, #32]\n",
                       "add {t}, {t}, {stride}\n", )+),
            "ld1 {{v0.8h, v1.8h, v2.8h, v3.8h}}, [{p}]",
            concat!($( "fmla v", $a0, ".8h, v0.8h, v4.h[", $lane, "]\n", "fmla v", $a1, ".8h, v1.8h, v4.h[", $lane, "]\n",
                       "fmla v", $a2, ".8h, v2.8h, v4.h[", $lane, "]\n", "fmla v", $a3, ".8h, v3.8h, v4.h[", $lane, "]\n", )+),
            concat!($( "fmul v", $a0, ".8h, v", $a0, ".8h, v4.h[", $ml, "]\n", "fmul v", $a1, ".8h, v", $a1, ".8h, v4.h[", $ml, "]\n",
                       "fmul v", $a2, ".8h, v", $a2, ".8h, v4.h[", $ml, "]\n", "fmul v", $a3, ".8h, v", $a3, ".8h, v4.h[", $ml, "]\n", )+));
    };
    ($name:ident, n, [$( ($lane:literal, $ml:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+]) => {
        hvalues_kernel!(@def $name,
            concat!("mov {t}, {a}\n", $( "ldr q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            concat!("mov {t}, {a}\n", $( "str q", $a0, ", [{t}]\n", "add {t}, {t}, {stride}\n", )+),
            "ldr q0, [{p}]",
            concat!($( "fmla v", $a0, ".8h, v0.8h, v4.h[", $lane, "]\n", )+),
            concat!($( "fmul v", $a0, ".8h, v", $a0, ".8h, v4.h[", $ml, "]\n", )+));
    };
    (@def $name:ident, $load:expr, $store:expr, $vload:expr, $mad:expr, $rescale:expr) => {
        /// # Safety
        /// `acc` points at row 0's accumulators of the slice (`R` rows `dv` f16 apart), each of
        /// `rows` at `dv` f16 values of which `d..` hold the slice; `w` and `raise` have at least
        /// `rows.len() > 0` entries; the CPU has FEAT_FP16.
        #[target_feature(enable = "neon,fp16")]
        unsafe fn $name(
            acc: *mut F16Le,
            dv: usize,
            d: usize,
            rows: &[*const F16Le],
            w: &[[u16; 8]; KEY_CHUNK],
            raise: &[u32; KEY_CHUNK],
        ) {
            debug_assert!(!rows.is_empty() && rows.len() <= KEY_CHUNK);
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    $load,
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "ldr q4, [{w}], #16",
                    "ldr {f:w}, [{raise}], #4",
                    "add {p}, {p}, {off}",
                    "cbnz {f:w}, 5f",
                    "3:",
                    $vload,
                    $mad,
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "b 6f",
                    "5:",
                    $rescale,
                    "b 3b",
                    "6:",
                    $store,
                    a = in(reg) acc,
                    t = out(reg) _,
                    stride = in(reg) 2 * dv,
                    off = in(reg) 2 * d,
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    w = inout(reg) w.as_ptr() => _,
                    raise = inout(reg) raise.as_ptr() => _,
                    p = out(reg) _,
                    f = out(reg) _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _,
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

hvalues_kernel!(hvalues1w, w, [("0", "4", "16", "17", "18", "19")]);
hvalues_kernel!(hvalues1n, n, [("0", "4", "16", "17", "18", "19")]);
hvalues_kernel!(hvalues2w, w, [("0", "4", "16", "17", "18", "19"), ("1", "5", "20", "21", "22", "23")]);
hvalues_kernel!(hvalues2n, n, [("0", "4", "16", "17", "18", "19"), ("1", "5", "20", "21", "22", "23")]);
hvalues_kernel!(
    hvalues3w,
    w,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27")
    ]
);
hvalues_kernel!(
    hvalues3n,
    n,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27")
    ]
);
hvalues_kernel!(
    hvalues4w,
    w,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27"),
        ("3", "7", "28", "29", "30", "31")
    ]
);
hvalues_kernel!(
    hvalues4n,
    n,
    [
        ("0", "4", "16", "17", "18", "19"),
        ("1", "5", "20", "21", "22", "23"),
        ("2", "6", "24", "25", "26", "27"),
        ("3", "7", "28", "29", "30", "31")
    ]
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// `expf4` against `libm::expf` on every 61st f32 in [-110, 0] and the mask's edges.
    #[test]
    fn expf4_is_bit_identical_where_it_says_so() {
        let mut xs: Vec<f32> = (0..=110f32.to_bits()).step_by(61).map(|b| -f32::from_bits(b)).collect();
        xs.extend([0.0, -0.0, -86.0, -85.99999, -86.00001, -90.0, 1.0, f32::NEG_INFINITY, f32::NAN, -1e30]);
        xs.extend([0x42cf_f1b4u32, 0x42cf_f1b5, 0x42cf_f1b6].map(|b| -f32::from_bits(b)));
        xs.extend(
            [0x3f85_1592u32, 0x3f85_1593, 0x3eb1_7218, 0x3eb1_7219, 0x3900_0000, 0x3900_0001]
                .map(|b| -f32::from_bits(b)),
        );
        while xs.len() % 4 != 0 {
            xs.push(-1.0);
        }
        for x in xs.chunks_exact(4) {
            // SAFETY: NEON is part of the aarch64 baseline.
            let (e, ok) = unsafe { expf4(vld1q_f32(x.as_ptr())) };
            let (mut got, mut mask) = ([0f32; 4], [0u32; 4]);
            // SAFETY: writes 4 lanes each.
            unsafe {
                vst1q_f32(got.as_mut_ptr(), e);
                vst1q_u32(mask.as_mut_ptr(), ok);
            }
            for i in 0..4 {
                let want = libm::expf(x[i]);
                let exact = mask[i] != 0;
                let flushed = x[i] <= -f32::from_bits(0x42cf_f1b5);
                assert_eq!(exact, (-86.0..=0.0).contains(&x[i]) || flushed, "mask of {}", x[i]);
                assert!(
                    !exact || got[i].to_bits() == want.to_bits(),
                    "expf({}) = {} vs {}",
                    x[i],
                    got[i],
                    want
                );
            }
        }
    }
}
