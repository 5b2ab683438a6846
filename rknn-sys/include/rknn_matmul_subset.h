/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * pinfer's own declarations of the matmul subset of Rockchip's librknnrt.so (runtime >= 2.1 ABI).
 *
 * Written from the facts collected in pinfer's docs (rknn-matmul.md: names, values, struct layouts
 * as the runtime expects them); this is not Rockchip's header and contains no text from it.
 * Rockchip's headers carry a proprietary notice: do not vendor them.
 *
 * Only LP64 targets (aarch64, and x86-64 for the CPU emulator) are described: on 32-bit ARM
 * rknn_context is 32 bits and rknn_tensor_mem has other offsets.
 *
 * rknn-sys/src/bindings.rs is generated from this file by bindgen (see rknn-sys/regen.sh); the
 * CPU emulator (rknn-sys/emulator/rknnrt_emu.c) implements it. pinfer never links the library:
 * every function is resolved with dlsym through the PFN_* pointer types below.
 */
#ifndef PINFER_RKNN_MATMUL_SUBSET_H
#define PINFER_RKNN_MATMUL_SUBSET_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- return codes: 0 on success, negative on failure ------------------------------------ */

#define RKNN_SUCC 0
#define RKNN_ERR_FAIL -1
#define RKNN_ERR_TIMEOUT -2
#define RKNN_ERR_DEVICE_UNAVAILABLE -3
#define RKNN_ERR_MALLOC_FAIL -4
/** Bad argument; also what create returns for a type the platform does not support. */
#define RKNN_ERR_PARAM_INVALID -5
#define RKNN_ERR_MODEL_INVALID -6
#define RKNN_ERR_CTX_INVALID -7
#define RKNN_ERR_INPUT_INVALID -8
#define RKNN_ERR_OUTPUT_INVALID -9
#define RKNN_ERR_DEVICE_UNMATCH -10
/* The misspelling "INCOMPATILE" is the vendor's own; kept so code ported from elsewhere matches. */
#define RKNN_ERR_INCOMPATILE_PRE_COMPILE_MODEL -11
#define RKNN_ERR_INCOMPATILE_OPTIMIZATION_LEVEL_VERSION -12
#define RKNN_ERR_TARGET_PLATFORM_UNMATCH -13

/* ---- constants --------------------------------------------------------------------------- */

#define RKNN_MAX_DIMS 16
#define RKNN_MAX_NAME_LEN 256
/** rknn_create_mem2 flag (>= 2.1): allocate without a context (ctx may be 0). */
#define RKNN_MEM_FLAG_ALLOC_NO_CONTEXT 0x20000

/* ---- handles ----------------------------------------------------------------------------- */

/** A runtime context (64-bit on aarch64). */
typedef uint64_t rknn_context;
/** A matmul context; usable wherever an rknn_context is expected (memory calls). */
typedef rknn_context rknn_matmul_ctx;

/* ---- enums (C enums are 4 bytes on aarch64-linux and x86-64 linux) ------------------------ */

/** Element type of one matrix, as reported in rknn_matmul_tensor_attr.type. */
typedef enum {
    RKNN_TENSOR_FLOAT32 = 0,
    RKNN_TENSOR_FLOAT16 = 1,
    RKNN_TENSOR_INT8 = 2,
    RKNN_TENSOR_UINT8 = 3,
    RKNN_TENSOR_INT16 = 4,
    RKNN_TENSOR_UINT16 = 5,
    RKNN_TENSOR_INT32 = 6,
    RKNN_TENSOR_UINT32 = 7,
    RKNN_TENSOR_INT64 = 8,
    RKNN_TENSOR_BOOL = 9,
    /* Two's-complement nibbles, two per byte, even element index in the low nibble (>= 2.0). */
    RKNN_TENSOR_INT4 = 10,
    RKNN_TENSOR_BFLOAT16 = 11,
} rknn_tensor_type;

/** A x B -> C element types of a matmul context. RK3588 accepts only 1, 2 and 10. */
typedef enum {
    RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32 = 1,
    RKNN_INT8_MM_INT8_TO_INT32 = 2,
    RKNN_INT8_MM_INT8_TO_INT8 = 3,
    RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT16 = 4,
    RKNN_FLOAT16_MM_INT8_TO_FLOAT32 = 5,
    RKNN_FLOAT16_MM_INT8_TO_FLOAT16 = 6,
    RKNN_FLOAT16_MM_INT4_TO_FLOAT32 = 7,
    RKNN_FLOAT16_MM_INT4_TO_FLOAT16 = 8,
    RKNN_INT8_MM_INT8_TO_FLOAT32 = 9,
    RKNN_INT4_MM_INT4_TO_INT16 = 10,
    RKNN_INT8_MM_INT4_TO_INT32 = 11,
    RKNN_FLOAT16_MM_INT4_TO_BFLOAT16 = 12,
    RKNN_INT8_MM_INT4_TO_FLOAT16 = 15,
} rknn_matmul_type;

/** Values of rknn_matmul_info.B_layout / AC_layout (stored there as int16_t). */
typedef enum {
    /* Row-major. */
    RKNN_MM_LAYOUT_NORM = 0,
    /* The NPU's tiled layout. */
    RKNN_MM_LAYOUT_NATIVE = 1,
    /* B only: transposed, row-major N x K. */
    RKNN_MM_LAYOUT_TP_NORM = 2,
} rknn_matmul_layout;

/** Values of rknn_matmul_info.B_quant_type / AC_quant_type (stored there as int16_t). */
typedef enum {
    RKNN_QUANT_TYPE_PER_LAYER_SYM = 0,
    RKNN_QUANT_TYPE_PER_LAYER_ASYM = 1,
    RKNN_QUANT_TYPE_PER_CHANNEL_SYM = 2,
    RKNN_QUANT_TYPE_PER_CHANNEL_ASYM = 3,
    RKNN_QUANT_TYPE_PER_GROUP_SYM = 4,
    RKNN_QUANT_TYPE_PER_GROUP_ASYM = 5,
} rknn_matmul_quant_type;

/** NPU core selection. RK3588 rejects multi-core masks for matmul contexts: use one context per core. */
typedef enum {
    RKNN_NPU_CORE_AUTO = 0,
    RKNN_NPU_CORE_0 = 1,
    RKNN_NPU_CORE_1 = 2,
    RKNN_NPU_CORE_2 = 4,
    RKNN_NPU_CORE_0_1 = 3,
    RKNN_NPU_CORE_0_1_2 = 7,
    RKNN_NPU_CORE_ALL = 0xffff,
    RKNN_NPU_CORE_UNDEFINED = 0x10000,
} rknn_core_mask;

/** rknn_tensor_mem.flags. */
typedef enum {
    RKNN_TENSOR_MEMORY_FLAGS_ALLOC_INSIDE = 1,
    RKNN_TENSOR_MEMORY_FLAGS_FROM_FD = 2,
    RKNN_TENSOR_MEMORY_FLAGS_FROM_PHYS = 3,
    RKNN_TENSOR_MEMORY_FLAGS_UNKNOWN = 4,
} rknn_tensor_mem_flags;

/** The alloc_flags argument of rknn_create_mem2 (may be or-ed with RKNN_MEM_FLAG_ALLOC_NO_CONTEXT). */
typedef enum {
    /* Same as CACHEABLE. */
    RKNN_FLAG_MEMORY_FLAGS_DEFAULT = 0,
    RKNN_FLAG_MEMORY_CACHEABLE = 1,
    RKNN_FLAG_MEMORY_NON_CACHEABLE = 2,
    /* >= 2.3.2. */
    RKNN_FLAG_MEMORY_TRY_ALLOC_SRAM = 4,
} rknn_mem_alloc_flags;

/** Cache maintenance direction for rknn_mem_sync. */
typedef enum {
    /* After CPU writes, before the NPU reads. */
    RKNN_MEMORY_SYNC_TO_DEVICE = 1,
    /* After the NPU writes, before the CPU reads. */
    RKNN_MEMORY_SYNC_FROM_DEVICE = 2,
    RKNN_MEMORY_SYNC_BIDIRECTIONAL = 3,
} rknn_mem_sync_mode;

/* ---- structs (sizes and offsets are asserted in rknn-sys/src/lib.rs and the emulator) ----- */

/** One matmul problem (>= 2.1 layout): 64 bytes, align 4. Zero it entirely before filling. */
typedef struct rknn_matmul_info_t {
    /** Rows of A and C. */
    int32_t M;
    /** Columns of A, rows of B. */
    int32_t K;
    /** Columns of B and C. */
    int32_t N;
    /** A x B -> C element types (offset 12). */
    rknn_matmul_type type;
    /** rknn_matmul_layout of B (offset 16). */
    int16_t B_layout;
    /** rknn_matmul_quant_type of B (offset 18). */
    int16_t B_quant_type;
    /** rknn_matmul_layout of A and C together: NORM or NATIVE (offset 20). */
    int16_t AC_layout;
    /** rknn_matmul_quant_type of A and C; only PER_LAYER_SYM (0) (offset 22). */
    int16_t AC_quant_type;
    /** IOMMU address space of this context's allocations, 0 by default (offset 24). */
    int32_t iommu_domain_id;
    /** Elements per quantization group along K, per-group B only (offset 28). */
    int16_t group_size;
    /** Must be zero (offset 30). */
    int8_t reserved[34];
} rknn_matmul_info;

/** One matrix of a context as the runtime reports it: 332 bytes, align 4. */
typedef struct rknn_matmul_tensor_attr {
    /** "A", "B" or "C"; NUL-terminated. */
    char name[RKNN_MAX_NAME_LEN];
    /** 2 normal / TP_NORM, 3 native A or C, 4 native B (offset 256). */
    uint32_t n_dims;
    /** Normal [rows, cols]; native A/C [X/s, M, s]; native B [N/sN, K/sK, sN, sK] (offset 260). */
    uint32_t dims[RKNN_MAX_DIMS];
    /** Buffer size in bytes (int4: half the element count) (offset 324). */
    uint32_t size;
    /** Element type (offset 328). */
    rknn_tensor_type type;
} rknn_matmul_tensor_attr;

/** What rknn_matmul_create reports for A, B and C: 996 bytes, align 4. */
typedef struct rknn_matmul_io_attr {
    rknn_matmul_tensor_attr A;
    rknn_matmul_tensor_attr B;
    rknn_matmul_tensor_attr C;
} rknn_matmul_io_attr;

/** One (M, K, N) of a dynamic-shape context: 12 bytes. */
typedef struct rknn_matmul_shape {
    int32_t M;
    int32_t K;
    int32_t N;
} rknn_matmul_shape;

/** Scales and zero points of one matrix (set_quant_params): 288 bytes, align 8, padded. */
typedef struct rknn_quant_params {
    /** Must equal io_attr.X.name of the matrix. */
    char name[RKNN_MAX_NAME_LEN];
    /** Offset 256. */
    float *scale;
    /** Offset 264. */
    int32_t scale_len;
    /** Offset 272 (4 bytes of padding before it). */
    int32_t *zp;
    /** Offset 280 (4 bytes of tail padding after it). */
    int32_t zp_len;
} rknn_quant_params;

/** A runtime-owned buffer: 40 bytes, align 8. Allocated and freed by the runtime only. */
typedef struct _rknn_tensor_memory {
    /** CPU mapping (offset 0). */
    void *virt_addr;
    /** Device address (offset 8). */
    uint64_t phys_addr;
    /** dma-buf file descriptor (offset 16). */
    int32_t fd;
    /** Offset of the data in the buffer (offset 20). */
    int32_t offset;
    /** Bytes (offset 24). */
    uint32_t size;
    /** rknn_tensor_mem_flags (offset 28). */
    uint32_t flags;
    /** Runtime-private (offset 32). */
    void *priv_data;
} rknn_tensor_mem;

/* ---- functions ---------------------------------------------------------------------------- */

/* Present since runtime 1.5/1.6. */
int rknn_matmul_create(rknn_matmul_ctx *ctx, rknn_matmul_info *info, rknn_matmul_io_attr *io_attr);
int rknn_matmul_set_io_mem(rknn_matmul_ctx ctx, rknn_tensor_mem *mem, rknn_matmul_tensor_attr *attr);
int rknn_matmul_set_core_mask(rknn_matmul_ctx context, rknn_core_mask core_mask);
int rknn_matmul_run(rknn_matmul_ctx ctx);
int rknn_matmul_destroy(rknn_matmul_ctx ctx);
rknn_tensor_mem *rknn_create_mem(rknn_context ctx, uint32_t size);
int rknn_destroy_mem(rknn_context ctx, rknn_tensor_mem *mem);
int rknn_mem_sync(rknn_context context, rknn_tensor_mem *mem, rknn_mem_sync_mode mode);
/* >= 2.0 (optional: resolve at run time and tolerate their absence). */
rknn_tensor_mem *rknn_create_mem2(rknn_context ctx, uint64_t size, uint64_t alloc_flags);
/* >= 2.1 five-parameter form (2.0.0-beta0 had an incompatible seven-parameter one). */
int rknn_B_normal_layout_to_native_layout(void *B_input, void *B_output, int K, int N, rknn_matmul_info *info);

/* Pointer types of the functions above, for dlsym (the emulator checks they match the prototypes). */
typedef int (*PFN_rknn_matmul_create)(rknn_matmul_ctx *ctx, rknn_matmul_info *info,
                                      rknn_matmul_io_attr *io_attr);
typedef int (*PFN_rknn_matmul_set_io_mem)(rknn_matmul_ctx ctx, rknn_tensor_mem *mem,
                                          rknn_matmul_tensor_attr *attr);
typedef int (*PFN_rknn_matmul_set_core_mask)(rknn_matmul_ctx context, rknn_core_mask core_mask);
typedef int (*PFN_rknn_matmul_run)(rknn_matmul_ctx ctx);
typedef int (*PFN_rknn_matmul_destroy)(rknn_matmul_ctx ctx);
typedef rknn_tensor_mem *(*PFN_rknn_create_mem)(rknn_context ctx, uint32_t size);
typedef int (*PFN_rknn_destroy_mem)(rknn_context ctx, rknn_tensor_mem *mem);
typedef int (*PFN_rknn_mem_sync)(rknn_context context, rknn_tensor_mem *mem, rknn_mem_sync_mode mode);
typedef rknn_tensor_mem *(*PFN_rknn_create_mem2)(rknn_context ctx, uint64_t size, uint64_t alloc_flags);
typedef int (*PFN_rknn_B_normal_layout_to_native_layout)(void *B_input, void *B_output, int K, int N,
                                                          rknn_matmul_info *info);

#ifdef __cplusplus
}
#endif

#endif /* PINFER_RKNN_MATMUL_SUBSET_H */
