/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * A CPU emulator of the matmul subset of Rockchip's librknnrt.so, as it behaves on RK3588 with a
 * 2.x runtime, for pinfer's tests. Built by rknn-sys/build.rs as a shared library named
 * librknnrt.so and loaded with dlopen (PINFER_RKNNRT=/path/to/it), exactly like the real one.
 *
 * Written from pinfer's fact sheet (docs/rknn-matmul.md), not from Rockchip's code.
 *
 * What it reproduces:
 *   - types 1 (f16 x f16 -> f32), 2 (i8 x i8 -> i32) and 10 (i4 x i4 -> i16), the only ones RK3588
 *     accepts; any other type fails at create with RKNN_ERR_PARAM_INVALID;
 *   - normal, native and (B only) TP_NORM layouts with RK3588's tiles: A/C native [X/s, M, s] with
 *     s(A) = 8 f16 / 16 i8 / 32 i4 and s(C) = 4 for 32-bit outputs / 8 for i16; B native
 *     [N/sN, K/sK, sN, sK] with (sN, sK) = (16, 32) f16 / (32, 32) i8 / (64, 32) i4, and B split
 *     into 8192-row segments along K when K > 8192;
 *   - int4 as two's-complement nibbles, even element index (in buffer order) in the low nibble;
 *   - create-time checks: K % 32, N % 16 (f16) / 32 (i8) / 64 (i4), 1 <= K <= 10240, sizes below
 *     2 GiB, known layouts, per-layer quantization only: RKNN_ERR_PARAM_INVALID (-5);
 *   - one core per context: AUTO or a single core is accepted; multi-core masks (0_1, 0_1_2, ALL)
 *     fail with RKNN_ERR_FAIL (-1), unknown masks with RKNN_ERR_PARAM_INVALID;
 *   - memory from rknn_create_mem/rknn_create_mem2 is a memfd mapping (so fd and virt_addr are
 *     real); rknn_mem_sync checks its arguments and does nothing;
 *   - rknn_B_normal_layout_to_native_layout (5-parameter form) taking int4 B unpacked, one value
 *     per byte, as the real runtime does.
 * Arithmetic: f16 products summed in f32 in k order; integers exact; the i16 output of int4 wraps.
 *
 * Knobs (environment, read on each call):
 *   RKNN_EMU_LOG=1            print each error to stderr as "E RKNN-EMU: ...".
 *   RKNN_EMU_FAIL_CREATE=<n>  rknn_matmul_create returns n (e.g. -3, device unavailable).
 *   RKNN_EMU_FAIL_RUN=<n>     rknn_matmul_run returns n (e.g. -2, timeout) once A, B and C are bound.
 * Extra exports for tests: rknn_emu_version, rknn_emu_run_count, rknn_emu_live_contexts,
 * rknn_emu_live_mems.
 *
 * Built with -DRKNN_EMU_V16=1 it omits the >= 2.0 exports (rknn_create_mem2 and
 * rknn_B_normal_layout_to_native_layout), like a 1.6 runtime.
 */
#define _GNU_SOURCE
#include "rknn_matmul_subset.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- ABI checks: the header's layouts are the ones the fact sheet gives ------------------- */

_Static_assert(sizeof(rknn_matmul_info) == 64, "rknn_matmul_info");
_Static_assert(offsetof(rknn_matmul_info, type) == 12, "info.type");
_Static_assert(offsetof(rknn_matmul_info, B_layout) == 16, "info.B_layout");
_Static_assert(offsetof(rknn_matmul_info, AC_layout) == 20, "info.AC_layout");
_Static_assert(offsetof(rknn_matmul_info, iommu_domain_id) == 24, "info.iommu_domain_id");
_Static_assert(offsetof(rknn_matmul_info, group_size) == 28, "info.group_size");
_Static_assert(offsetof(rknn_matmul_info, reserved) == 30, "info.reserved");
_Static_assert(sizeof(rknn_matmul_tensor_attr) == 332, "rknn_matmul_tensor_attr");
_Static_assert(offsetof(rknn_matmul_tensor_attr, n_dims) == 256, "attr.n_dims");
_Static_assert(offsetof(rknn_matmul_tensor_attr, size) == 324, "attr.size");
_Static_assert(offsetof(rknn_matmul_tensor_attr, type) == 328, "attr.type");
_Static_assert(sizeof(rknn_matmul_io_attr) == 996, "rknn_matmul_io_attr");
_Static_assert(sizeof(rknn_matmul_shape) == 12, "rknn_matmul_shape");
_Static_assert(sizeof(rknn_quant_params) == 288, "rknn_quant_params");
_Static_assert(offsetof(rknn_quant_params, zp) == 272, "quant.zp");
_Static_assert(sizeof(rknn_tensor_mem) == 40, "rknn_tensor_mem");
_Static_assert(offsetof(rknn_tensor_mem, fd) == 16, "mem.fd");
_Static_assert(offsetof(rknn_tensor_mem, size) == 24, "mem.size");
_Static_assert(offsetof(rknn_tensor_mem, priv_data) == 32, "mem.priv_data");
_Static_assert(sizeof(rknn_core_mask) == 4, "enums are 4 bytes");

/* The PFN_* types the Rust side resolves with dlsym must match the prototypes (a mismatch is an
 * incompatible-pointer-types error, made fatal by build.rs). */
#define PFN_CHECK(f) static PFN_##f const pfn_check_##f __attribute__((unused)) = f
PFN_CHECK(rknn_matmul_create);
PFN_CHECK(rknn_matmul_set_io_mem);
PFN_CHECK(rknn_matmul_set_core_mask);
PFN_CHECK(rknn_matmul_run);
PFN_CHECK(rknn_matmul_destroy);
PFN_CHECK(rknn_create_mem);
PFN_CHECK(rknn_destroy_mem);
PFN_CHECK(rknn_mem_sync);
#ifndef RKNN_EMU_V16
PFN_CHECK(rknn_create_mem2);
PFN_CHECK(rknn_B_normal_layout_to_native_layout);
#endif

#define EXPORT __attribute__((visibility("default")))

/* ---- limits of RK3588 --------------------------------------------------------------------- */

#define EMU_K_MAX 10240
#define EMU_K_SEGMENT 8192
/* One IOMMU domain holds just under 2 GiB. */
#define EMU_MAX_BYTES ((uint64_t)INT32_MAX - 65536)
#define EMU_SLOTS 4096

/* ---- logging ------------------------------------------------------------------------------- */

static void emu_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emu_log(const char *fmt, ...) {
    const char *v = getenv("RKNN_EMU_LOG");
    if (v == NULL || v[0] == '\0' || v[0] == '0') return;
    va_list ap;
    va_start(ap, fmt);
    fputs("E RKNN-EMU: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- element types per matmul type ---------------------------------------------------------- */

enum elem { E_F16, E_I8, E_I4, E_F32, E_I32, E_I16 };

struct type_desc {
    enum elem a, b, c;
    int a_tile;        /* native A: s */
    int b_tile_n;      /* native B: sN */
    int b_tile_k;      /* native B: sK */
    int c_tile;        /* native C: s */
    int k_align, n_align;
};

static int type_desc_of(int type, struct type_desc *d) {
    switch (type) {
    case RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32:
        *d = (struct type_desc){E_F16, E_F16, E_F32, 8, 16, 32, 4, 32, 16};
        return 1;
    case RKNN_INT8_MM_INT8_TO_INT32:
        *d = (struct type_desc){E_I8, E_I8, E_I32, 16, 32, 32, 4, 32, 32};
        return 1;
    case RKNN_INT4_MM_INT4_TO_INT16:
        *d = (struct type_desc){E_I4, E_I4, E_I16, 32, 64, 32, 8, 32, 64};
        return 1;
    default:
        return 0;
    }
}

static rknn_tensor_type tensor_type_of(enum elem e) {
    switch (e) {
    case E_F16: return RKNN_TENSOR_FLOAT16;
    case E_I8: return RKNN_TENSOR_INT8;
    case E_I4: return RKNN_TENSOR_INT4;
    case E_F32: return RKNN_TENSOR_FLOAT32;
    case E_I32: return RKNN_TENSOR_INT32;
    case E_I16: return RKNN_TENSOR_INT16;
    }
    return RKNN_TENSOR_FLOAT32;
}

/* Bytes of `count` elements (int4: two per byte). */
static uint64_t bytes_of(enum elem e, uint64_t count) {
    switch (e) {
    case E_I4: return count / 2;
    case E_I8: return count;
    case E_F16: case E_I16: return count * 2;
    case E_F32: case E_I32: return count * 4;
    }
    return 0;
}

/* ---- layouts: element index of a logical element ------------------------------------------ */

/* Native A/C: [X/s, M, s]. */
static size_t native_ac_index(int rows, int s, int m, int x) {
    return (size_t)(x / s) * (size_t)rows * (size_t)s + (size_t)m * (size_t)s + (size_t)(x % s);
}

/* Native B: [N/sN, K/sK, sN, sK] per K segment of at most 8192 rows, segments concatenated. */
static size_t native_b_index(int K, int N, int sn, int sk, int k, int n) {
    size_t seg = (size_t)(k / EMU_K_SEGMENT);
    int k0 = (int)seg * EMU_K_SEGMENT;
    int kt = K - k0 < EMU_K_SEGMENT ? K - k0 : EMU_K_SEGMENT;
    int kk = k - k0;
    size_t base = (size_t)k0 * (size_t)N;
    size_t tile = (size_t)(n / sn) * (size_t)(kt / sk) + (size_t)(kk / sk);
    return base + tile * (size_t)sn * (size_t)sk + (size_t)(n % sn) * (size_t)sk + (size_t)(kk % sk);
}

static size_t b_index(int layout, int K, int N, const struct type_desc *d, int k, int n) {
    switch (layout) {
    case RKNN_MM_LAYOUT_NATIVE: return native_b_index(K, N, d->b_tile_n, d->b_tile_k, k, n);
    case RKNN_MM_LAYOUT_TP_NORM: return (size_t)n * (size_t)K + (size_t)k;
    default: return (size_t)k * (size_t)N + (size_t)n;
    }
}

/* ---- element access ----------------------------------------------------------------------- */

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) {
        /* Zero or subnormal: man * 2^-24, exact in f32. */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static int read_i4(const uint8_t *p, size_t idx) {
    uint8_t byte = p[idx >> 1];
    int v = (idx & 1) ? (byte >> 4) : (byte & 0x0f);
    return v >= 8 ? v - 16 : v;
}

#ifndef RKNN_EMU_V16
static void write_i4(uint8_t *p, size_t idx, int v) {
    uint8_t nib = (uint8_t)(v & 0x0f);
    if (idx & 1)
        p[idx >> 1] = (uint8_t)((p[idx >> 1] & 0x0f) | (nib << 4));
    else
        p[idx >> 1] = (uint8_t)((p[idx >> 1] & 0xf0) | nib);
}
#endif

/* Reads element `idx` of an input buffer as float (f16) or as an integer (i8, i4). */
static float read_f(enum elem e, const void *p, size_t idx) {
    (void)e;
    uint16_t h;
    memcpy(&h, (const uint8_t *)p + idx * 2, 2);
    return f16_to_f32(h);
}

static int32_t read_i(enum elem e, const void *p, size_t idx) {
    if (e == E_I4) return read_i4((const uint8_t *)p, idx);
    return ((const int8_t *)p)[idx];
}

/* ---- contexts ----------------------------------------------------------------------------- */

struct emu_ctx {
    uint64_t id;
    rknn_matmul_info info;
    rknn_matmul_io_attr io;
    struct type_desc d;
    rknn_core_mask mask;
    rknn_tensor_mem *a, *b, *c;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct emu_ctx *g_slots[EMU_SLOTS];
static uint64_t g_next_id = 1;
static int g_live_contexts;
static int g_live_mems;
static uint64_t g_runs[4]; /* cores 0..2, then AUTO */
static uint64_t g_next_iova = 0x10000000u;

static struct emu_ctx *ctx_get(rknn_matmul_ctx h) {
    struct emu_ctx *c;
    if (h == 0) return NULL;
    pthread_mutex_lock(&g_lock);
    c = g_slots[h % EMU_SLOTS];
    if (c != NULL && c->id != h) c = NULL;
    pthread_mutex_unlock(&g_lock);
    return c;
}

static int env_int(const char *name, int *out) {
    const char *v = getenv(name);
    char *end;
    long n;
    if (v == NULL || v[0] == '\0') return 0;
    n = strtol(v, &end, 0);
    if (*end != '\0') return 0;
    *out = (int)n;
    return 1;
}

static void set_attr(rknn_matmul_tensor_attr *a, const char *name, enum elem e, uint64_t count,
                     uint32_t n_dims, const uint32_t *dims) {
    snprintf(a->name, sizeof a->name, "%s", name);
    a->n_dims = n_dims;
    for (uint32_t i = 0; i < n_dims; i++) a->dims[i] = dims[i];
    a->size = (uint32_t)bytes_of(e, count);
    a->type = tensor_type_of(e);
}

/* Checks K and N against the type's alignment and limits; RKNN_SUCC or RKNN_ERR_PARAM_INVALID. */
static int check_kn(const struct type_desc *d, int K, int N) {
    if (K <= 0 || N <= 0) {
        emu_log("invalid K = %d or N = %d", K, N);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (K % d->k_align != 0) {
        emu_log("K = %d must be aligned to %d", K, d->k_align);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (N % d->n_align != 0) {
        emu_log("N = %d must be aligned to %d", N, d->n_align);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (K > EMU_K_MAX) {
        emu_log("K = %d exceeds the maximum %d", K, EMU_K_MAX);
        return RKNN_ERR_PARAM_INVALID;
    }
    return RKNN_SUCC;
}

EXPORT int rknn_matmul_create(rknn_matmul_ctx *ctx, rknn_matmul_info *info, rknn_matmul_io_attr *io_attr) {
    struct type_desc d;
    struct emu_ctx *c;
    int fail, ret;
    if (ctx == NULL || info == NULL || io_attr == NULL) {
        emu_log("rknn_matmul_create: NULL argument");
        return RKNN_ERR_PARAM_INVALID;
    }
    if (env_int("RKNN_EMU_FAIL_CREATE", &fail) && fail != 0) {
        emu_log("rknn_matmul_create: failing with %d (RKNN_EMU_FAIL_CREATE)", fail);
        return fail;
    }
    if (!type_desc_of((int)info->type, &d)) {
        emu_log("unsupported matmul dtype %d in this platform", (int)info->type);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (info->B_layout < RKNN_MM_LAYOUT_NORM || info->B_layout > RKNN_MM_LAYOUT_TP_NORM ||
        info->AC_layout < RKNN_MM_LAYOUT_NORM || info->AC_layout > RKNN_MM_LAYOUT_NATIVE) {
        emu_log("invalid layout B = %d, AC = %d", info->B_layout, info->AC_layout);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (info->B_quant_type != RKNN_QUANT_TYPE_PER_LAYER_SYM ||
        info->AC_quant_type != RKNN_QUANT_TYPE_PER_LAYER_SYM) {
        emu_log("unsupported quant type B = %d, AC = %d", info->B_quant_type, info->AC_quant_type);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (info->iommu_domain_id < 0 || info->iommu_domain_id > 15) {
        emu_log("invalid iommu_domain_id %d", info->iommu_domain_id);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (info->M <= 0) {
        emu_log("invalid M = %d", info->M);
        return RKNN_ERR_PARAM_INVALID;
    }
    ret = check_kn(&d, info->K, info->N);
    if (ret != RKNN_SUCC) return ret;
    {
        uint64_t M = (uint64_t)info->M, K = (uint64_t)info->K, N = (uint64_t)info->N;
        if (bytes_of(d.a, M * K) > EMU_MAX_BYTES || bytes_of(d.b, K * N) > EMU_MAX_BYTES ||
            bytes_of(d.c, M * N) > EMU_MAX_BYTES) {
            emu_log("matrix too large for one IOMMU domain (M = %d, K = %d, N = %d)", info->M, info->K,
                    info->N);
            return RKNN_ERR_PARAM_INVALID;
        }
    }

    c = calloc(1, sizeof *c);
    if (c == NULL) return RKNN_ERR_MALLOC_FAIL;
    c->info = *info;
    c->d = d;
    c->mask = RKNN_NPU_CORE_AUTO;
    {
        uint32_t M = (uint32_t)info->M, K = (uint32_t)info->K, N = (uint32_t)info->N;
        rknn_matmul_io_attr *io = &c->io;
        if (info->AC_layout == RKNN_MM_LAYOUT_NATIVE) {
            uint32_t da[3] = {K / (uint32_t)d.a_tile, M, (uint32_t)d.a_tile};
            uint32_t dc[3] = {N / (uint32_t)d.c_tile, M, (uint32_t)d.c_tile};
            set_attr(&io->A, "A", d.a, (uint64_t)M * K, 3, da);
            set_attr(&io->C, "C", d.c, (uint64_t)M * N, 3, dc);
        } else {
            uint32_t da[2] = {M, K}, dc[2] = {M, N};
            set_attr(&io->A, "A", d.a, (uint64_t)M * K, 2, da);
            set_attr(&io->C, "C", d.c, (uint64_t)M * N, 2, dc);
        }
        if (info->B_layout == RKNN_MM_LAYOUT_NATIVE) {
            uint32_t db[4] = {N / (uint32_t)d.b_tile_n, K / (uint32_t)d.b_tile_k, (uint32_t)d.b_tile_n,
                              (uint32_t)d.b_tile_k};
            set_attr(&io->B, "B", d.b, (uint64_t)K * N, 4, db);
        } else if (info->B_layout == RKNN_MM_LAYOUT_TP_NORM) {
            uint32_t db[2] = {N, K};
            set_attr(&io->B, "B", d.b, (uint64_t)K * N, 2, db);
        } else {
            uint32_t db[2] = {K, N};
            set_attr(&io->B, "B", d.b, (uint64_t)K * N, 2, db);
        }
    }

    pthread_mutex_lock(&g_lock);
    for (int tries = 0; tries < EMU_SLOTS; tries++) {
        uint64_t id = g_next_id++;
        if (g_slots[id % EMU_SLOTS] == NULL) {
            c->id = id;
            g_slots[id % EMU_SLOTS] = c;
            g_live_contexts++;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (c->id == 0) {
        free(c);
        emu_log("too many matmul contexts");
        return RKNN_ERR_MALLOC_FAIL;
    }
    memset(io_attr, 0, sizeof *io_attr);
    *io_attr = c->io;
    *ctx = c->id;
    return RKNN_SUCC;
}

EXPORT int rknn_matmul_destroy(rknn_matmul_ctx ctx) {
    struct emu_ctx *c = NULL;
    if (ctx != 0) {
        pthread_mutex_lock(&g_lock);
        c = g_slots[ctx % EMU_SLOTS];
        if (c != NULL && c->id == ctx) {
            g_slots[ctx % EMU_SLOTS] = NULL;
            g_live_contexts--;
        } else {
            c = NULL;
        }
        pthread_mutex_unlock(&g_lock);
    }
    if (c == NULL) {
        emu_log("rknn_matmul_destroy: invalid context %llu", (unsigned long long)ctx);
        return RKNN_ERR_CTX_INVALID;
    }
    free(c);
    return RKNN_SUCC;
}

EXPORT int rknn_matmul_set_core_mask(rknn_matmul_ctx context, rknn_core_mask core_mask) {
    struct emu_ctx *c = ctx_get(context);
    if (c == NULL) {
        emu_log("rknn_matmul_set_core_mask: invalid context");
        return RKNN_ERR_CTX_INVALID;
    }
    switch ((unsigned)core_mask) {
    case RKNN_NPU_CORE_AUTO:
    case RKNN_NPU_CORE_0:
    case RKNN_NPU_CORE_1:
    case RKNN_NPU_CORE_2:
        c->mask = core_mask;
        return RKNN_SUCC;
    case RKNN_NPU_CORE_0_1:
    case RKNN_NPU_CORE_0_1_2:
    case RKNN_NPU_CORE_ALL:
        emu_log("matmul does not support multi-core mask %#x: use one context per core",
                (unsigned)core_mask);
        return RKNN_ERR_FAIL;
    default:
        emu_log("invalid core mask %#x", (unsigned)core_mask);
        return RKNN_ERR_PARAM_INVALID;
    }
}

/* ---- memory ------------------------------------------------------------------------------- */

#define EMU_MEM_MAGIC 0x454d2d4e4e4b52ull /* "RKNN-ME" */

struct emu_mem {
    uint64_t magic;
    void *map;
    size_t map_len;
    int fd;
};

static struct emu_mem *mem_priv(rknn_tensor_mem *mem) {
    struct emu_mem *p;
    if (mem == NULL || mem->priv_data == NULL) return NULL;
    p = mem->priv_data;
    return p->magic == EMU_MEM_MAGIC ? p : NULL;
}

static rknn_tensor_mem *mem_alloc(uint64_t size) {
    rknn_tensor_mem *mem;
    struct emu_mem *p;
    size_t len;
    int fd;
    void *map;
    if (size == 0 || size > EMU_MAX_BYTES) {
        emu_log("cannot allocate %llu bytes", (unsigned long long)size);
        return NULL;
    }
    len = (size_t)((size + 4095u) & ~(uint64_t)4095u);
    /* A memfd stands for the dma-buf: a real fd and a shared mapping, zero-filled. */
    fd = memfd_create("rknn-emu", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        fd = -1;
    }
    if (fd >= 0) {
        map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    } else {
        map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (map == MAP_FAILED) {
        if (fd >= 0) close(fd);
        emu_log("mmap of %zu bytes failed: %s", len, strerror(errno));
        return NULL;
    }
    mem = calloc(1, sizeof *mem);
    p = calloc(1, sizeof *p);
    if (mem == NULL || p == NULL) {
        free(mem);
        free(p);
        munmap(map, len);
        if (fd >= 0) close(fd);
        return NULL;
    }
    p->magic = EMU_MEM_MAGIC;
    p->map = map;
    p->map_len = len;
    p->fd = fd;
    mem->virt_addr = map;
    mem->fd = fd;
    mem->offset = 0;
    mem->size = (uint32_t)size;
    mem->flags = RKNN_TENSOR_MEMORY_FLAGS_ALLOC_INSIDE;
    mem->priv_data = p;
    pthread_mutex_lock(&g_lock);
    mem->phys_addr = g_next_iova;
    g_next_iova += len;
    g_live_mems++;
    pthread_mutex_unlock(&g_lock);
    return mem;
}

EXPORT rknn_tensor_mem *rknn_create_mem(rknn_context ctx, uint32_t size) {
    if (ctx_get(ctx) == NULL) {
        emu_log("rknn_create_mem: invalid context");
        return NULL;
    }
    return mem_alloc(size);
}

#ifndef RKNN_EMU_V16
EXPORT rknn_tensor_mem *rknn_create_mem2(rknn_context ctx, uint64_t size, uint64_t alloc_flags) {
    uint64_t known = RKNN_FLAG_MEMORY_CACHEABLE | RKNN_FLAG_MEMORY_NON_CACHEABLE |
                     RKNN_FLAG_MEMORY_TRY_ALLOC_SRAM | RKNN_MEM_FLAG_ALLOC_NO_CONTEXT;
    if ((alloc_flags & ~known) != 0) {
        emu_log("rknn_create_mem2: unknown flags %#llx", (unsigned long long)alloc_flags);
        return NULL;
    }
    if (!(alloc_flags & RKNN_MEM_FLAG_ALLOC_NO_CONTEXT) && ctx_get(ctx) == NULL) {
        emu_log("rknn_create_mem2: invalid context");
        return NULL;
    }
    return mem_alloc(size);
}
#endif

EXPORT int rknn_destroy_mem(rknn_context ctx, rknn_tensor_mem *mem) {
    /* Any context may free any buffer (rk-llama relies on it). */
    struct emu_mem *p = mem_priv(mem);
    (void)ctx;
    if (p == NULL) {
        emu_log("rknn_destroy_mem: not a runtime buffer");
        return RKNN_ERR_PARAM_INVALID;
    }
    munmap(p->map, p->map_len);
    if (p->fd >= 0) close(p->fd);
    p->magic = 0;
    free(p);
    free(mem);
    pthread_mutex_lock(&g_lock);
    g_live_mems--;
    pthread_mutex_unlock(&g_lock);
    return RKNN_SUCC;
}

EXPORT int rknn_mem_sync(rknn_context context, rknn_tensor_mem *mem, rknn_mem_sync_mode mode) {
    (void)context;
    if (mem_priv(mem) == NULL) {
        emu_log("rknn_mem_sync: not a runtime buffer");
        return RKNN_ERR_PARAM_INVALID;
    }
    if (mode != RKNN_MEMORY_SYNC_TO_DEVICE && mode != RKNN_MEMORY_SYNC_FROM_DEVICE &&
        mode != RKNN_MEMORY_SYNC_BIDIRECTIONAL) {
        emu_log("rknn_mem_sync: invalid mode %d", (int)mode);
        return RKNN_ERR_PARAM_INVALID;
    }
    return RKNN_SUCC; /* host memory: nothing to flush */
}

/* ---- binding and running ------------------------------------------------------------------ */

EXPORT int rknn_matmul_set_io_mem(rknn_matmul_ctx ctx, rknn_tensor_mem *mem, rknn_matmul_tensor_attr *attr) {
    struct emu_ctx *c = ctx_get(ctx);
    const rknn_matmul_tensor_attr *own;
    rknn_tensor_mem **slot;
    if (c == NULL) {
        emu_log("rknn_matmul_set_io_mem: invalid context");
        return RKNN_ERR_CTX_INVALID;
    }
    if (mem == NULL || attr == NULL || mem->virt_addr == NULL) {
        emu_log("rknn_matmul_set_io_mem: NULL argument");
        return RKNN_ERR_PARAM_INVALID;
    }
    if (strcmp(attr->name, "A") == 0) {
        own = &c->io.A;
        slot = &c->a;
    } else if (strcmp(attr->name, "B") == 0) {
        own = &c->io.B;
        slot = &c->b;
    } else if (strcmp(attr->name, "C") == 0) {
        own = &c->io.C;
        slot = &c->c;
    } else {
        emu_log("rknn_matmul_set_io_mem: unknown tensor name \"%.16s\"", attr->name);
        return RKNN_ERR_PARAM_INVALID;
    }
    if (mem->offset < 0 || (uint64_t)mem->size < (uint64_t)mem->offset + own->size) {
        emu_log("rknn_matmul_set_io_mem: buffer of %u bytes (offset %d) too small for %s (%u bytes)",
                mem->size, mem->offset, own->name, own->size);
        return RKNN_ERR_PARAM_INVALID;
    }
    *slot = mem;
    return RKNN_SUCC;
}

EXPORT int rknn_matmul_run(rknn_matmul_ctx ctx) {
    struct emu_ctx *c = ctx_get(ctx);
    const struct type_desc *d;
    const uint8_t *pa, *pb;
    uint8_t *pc;
    int M, K, N, native_ac, core;
    if (c == NULL) {
        emu_log("rknn_matmul_run: invalid context");
        return RKNN_ERR_CTX_INVALID;
    }
    if (c->a == NULL || c->b == NULL) {
        emu_log("rknn_matmul_run: input %s not set", c->a == NULL ? "A" : "B");
        return RKNN_ERR_INPUT_INVALID;
    }
    if (c->c == NULL) {
        emu_log("rknn_matmul_run: output C not set");
        return RKNN_ERR_OUTPUT_INVALID;
    }
    {
        int fail;
        if (env_int("RKNN_EMU_FAIL_RUN", &fail) && fail != 0) {
            emu_log("rknn_matmul_run: failing with %d (RKNN_EMU_FAIL_RUN)", fail);
            return fail;
        }
    }
    d = &c->d;
    M = c->info.M;
    K = c->info.K;
    N = c->info.N;
    native_ac = c->info.AC_layout == RKNN_MM_LAYOUT_NATIVE;
    pa = (const uint8_t *)c->a->virt_addr + c->a->offset;
    pb = (const uint8_t *)c->b->virt_addr + c->b->offset;
    pc = (uint8_t *)c->c->virt_addr + c->c->offset;

    if (d->a == E_F16) {
        float *a = malloc(sizeof(float) * (size_t)M * (size_t)K);
        float *col = malloc(sizeof(float) * (size_t)K);
        if (a == NULL || col == NULL) {
            free(a);
            free(col);
            return RKNN_ERR_MALLOC_FAIL;
        }
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                size_t i = native_ac ? native_ac_index(M, d->a_tile, m, k) : (size_t)m * K + k;
                a[(size_t)m * K + k] = read_f(d->a, pa, i);
            }
        for (int n = 0; n < N; n++) {
            for (int k = 0; k < K; k++) col[k] = read_f(d->b, pb, b_index(c->info.B_layout, K, N, d, k, n));
            for (int m = 0; m < M; m++) {
                const float *row = a + (size_t)m * K;
                float acc = 0.0f;
                for (int k = 0; k < K; k++) acc += row[k] * col[k];
                size_t o = native_ac ? native_ac_index(M, d->c_tile, m, n) : (size_t)m * N + n;
                memcpy(pc + o * 4, &acc, 4);
            }
        }
        free(a);
        free(col);
    } else {
        int32_t *a = malloc(sizeof(int32_t) * (size_t)M * (size_t)K);
        int32_t *col = malloc(sizeof(int32_t) * (size_t)K);
        if (a == NULL || col == NULL) {
            free(a);
            free(col);
            return RKNN_ERR_MALLOC_FAIL;
        }
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                size_t i = native_ac ? native_ac_index(M, d->a_tile, m, k) : (size_t)m * K + k;
                a[(size_t)m * K + k] = read_i(d->a, pa, i);
            }
        for (int n = 0; n < N; n++) {
            for (int k = 0; k < K; k++) col[k] = read_i(d->b, pb, b_index(c->info.B_layout, K, N, d, k, n));
            for (int m = 0; m < M; m++) {
                const int32_t *row = a + (size_t)m * K;
                int32_t acc = 0;
                for (int k = 0; k < K; k++) acc += row[k] * col[k];
                size_t o = native_ac ? native_ac_index(M, d->c_tile, m, n) : (size_t)m * N + n;
                if (d->c == E_I16) {
                    /* Wraps: whether the NPU wraps or saturates is unknown. */
                    int16_t v = (int16_t)(uint16_t)(uint32_t)acc;
                    memcpy(pc + o * 2, &v, 2);
                } else {
                    memcpy(pc + o * 4, &acc, 4);
                }
            }
        }
        free(a);
        free(col);
    }

    switch ((unsigned)c->mask) {
    case RKNN_NPU_CORE_0: core = 0; break;
    case RKNN_NPU_CORE_1: core = 1; break;
    case RKNN_NPU_CORE_2: core = 2; break;
    default: core = 3; break;
    }
    __atomic_fetch_add(&g_runs[core], 1, __ATOMIC_RELAXED);
    return RKNN_SUCC;
}

/* ---- the CPU helper ----------------------------------------------------------------------- */

#ifndef RKNN_EMU_V16
EXPORT int rknn_B_normal_layout_to_native_layout(void *B_input, void *B_output, int K, int N,
                                                  rknn_matmul_info *info) {
    struct type_desc d;
    int ret;
    if (B_input == NULL || B_output == NULL || info == NULL) {
        emu_log("rknn_B_normal_layout_to_native_layout: NULL argument");
        return RKNN_ERR_PARAM_INVALID;
    }
    if (!type_desc_of((int)info->type, &d)) {
        emu_log("rknn_B_normal_layout_to_native_layout: unsupported matmul dtype %d", (int)info->type);
        return RKNN_ERR_PARAM_INVALID;
    }
    ret = check_kn(&d, K, N);
    if (ret != RKNN_SUCC) return ret;
    for (int k = 0; k < K; k++) {
        for (int n = 0; n < N; n++) {
            size_t src = (size_t)k * N + n;
            size_t dst = native_b_index(K, N, d.b_tile_n, d.b_tile_k, k, n);
            switch (d.b) {
            case E_F16:
                memcpy((uint8_t *)B_output + dst * 2, (const uint8_t *)B_input + src * 2, 2);
                break;
            case E_I8:
                ((int8_t *)B_output)[dst] = ((const int8_t *)B_input)[src];
                break;
            default:
                /* int4: the input is unpacked, one value per byte; the output is packed. */
                write_i4(B_output, dst, ((const int8_t *)B_input)[src]);
                break;
            }
        }
    }
    return RKNN_SUCC;
}
#endif

/* ---- test-only exports -------------------------------------------------------------------- */

EXPORT const char *rknn_emu_version(void) {
#ifdef RKNN_EMU_V16
    return "pinfer rknnrt emulator (1.6 symbol set)";
#else
    return "pinfer rknnrt emulator (2.x symbol set)";
#endif
}

/* Runs completed on NPU core 0, 1, 2, or (core = 3) with the AUTO mask. */
EXPORT uint64_t rknn_emu_run_count(int core) {
    if (core < 0 || core > 3) return 0;
    return __atomic_load_n(&g_runs[core], __ATOMIC_RELAXED);
}

EXPORT int rknn_emu_live_contexts(void) {
    int n;
    pthread_mutex_lock(&g_lock);
    n = g_live_contexts;
    pthread_mutex_unlock(&g_lock);
    return n;
}

EXPORT int rknn_emu_live_mems(void) {
    int n;
    pthread_mutex_lock(&g_lock);
    n = g_live_mems;
    pthread_mutex_unlock(&g_lock);
    return n;
}
