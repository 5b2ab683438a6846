//! Packed matmul with `sdot`: tiles of 2 groups x up to 4 tokens, a single token over 4 groups,
//! wide tiles of 1 group x 16 tokens.

use core::arch::asm;
use core::ops::Range;

use super::*;
use crate::kernels::layout::{self, Layout};
use crate::kernels::packed::{ActBlock, PackedMatrix, GROUP_ROWS};
use crate::kernels::reference::matmul_ref;

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

/// A layout's `sdot` kernels: the single-token pass, the tiles of 1 to 4 (or 3) tokens, the wide
/// tile of 16 tokens.
pub struct DotKernels {
    gemv: DotKernel,
    tiles: &'static [DotKernel],
    wide: WideKernel,
}

/// A layout with `sdot` kernels: the 4- and 8-bit ones (the others are widened or decoded into
/// these first, see [`crate::kernels::matmul`]).
pub trait DotLayout: Layout {
    /// Its kernels.
    const KERNELS: DotKernels;
}

impl DotLayout for layout::Q4 {
    const KERNELS: DotKernels =
        DotKernels { gemv: q4_gemv, tiles: &[q4_t1, q4_t2, q4_t3, q4_t4], wide: q4_wide };
}
impl DotLayout for layout::Q8 {
    const KERNELS: DotKernels =
        DotKernels { gemv: q8_gemv, tiles: &[q8_t1, q8_t2, q8_t3, q8_t4], wide: q8_wide };
}
impl DotLayout for layout::Q4Min {
    const KERNELS: DotKernels =
        DotKernels { gemv: q4m_gemv, tiles: &[q4m_t1, q4m_t2, q4m_t3], wide: q4m_wide };
}
impl DotLayout for layout::Q8Min {
    const KERNELS: DotKernels =
        DotKernels { gemv: q8m_gemv, tiles: &[q8m_t1, q8m_t2, q8m_t3], wide: q8m_wide };
}
impl DotLayout for layout::Q8Sub16 {
    const KERNELS: DotKernels =
        DotKernels { gemv: q8s_gemv, tiles: &[q8s_t1, q8s_t2, q8s_t3], wide: q8s_wide };
}

/// Packed matmul of layout `L` with `sdot` (the contract of
/// [`crate::kernels::reference::matmul_ref`]; a matrix of another format runs the reference): one
/// token runs 16 rows per pass; more run 4 rows x 16 tokens while 16 are left, then tiles of 8
/// rows x up to 4 tokens (3 for the two-scale formats).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn matmul_dotprod<L: DotLayout>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    if w.format != L::FORMAT {
        return matmul_ref(w, groups, acts, outs);
    }
    // SAFETY: the kernels are `w`'s format's; the CPU has dotprod (our contract).
    unsafe { dot_tiles(w, groups, acts, outs, &L::KERNELS) }
}

/// [`matmul_dotprod`] on kernels `k` (one copy of the driver for every layout).
///
/// # Safety
/// `k` holds the kernels of `w`'s format; the CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
unsafe fn dot_tiles(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    k: &DotKernels,
) {
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    let (gemv, tiles, wide) = (k.gemv, k.tiles, k.wide);
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
