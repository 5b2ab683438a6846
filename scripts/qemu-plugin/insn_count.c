/*
 * insn_count: a QEMU TCG plugin that counts the guest instructions a program executes and prints
 * the total when it exits. scripts/insn_per_token.sh uses it to measure instructions per token.
 *
 *   gcc -O2 -shared -fPIC -o insn_count.so insn_count.c
 *   qemu-aarch64 -cpu cortex-a76 -plugin ./insn_count.so,out=FILE ./program ...
 *
 * Arguments (comma-separated after the plugin path):
 *   out=FILE     write the total to FILE (one line: the number) instead of stderr
 *   inline=off   count in a callback with an atomic add instead of an inline add (exact for
 *                multi-threaded guests under the API-v1 counter; slower)
 *
 * Counting: when a translation block is translated, an inline "add its instruction count" op is
 * attached to it, so every execution of the block adds that many instructions (the standard
 * approach of QEMU's contrib/plugins; a block left early by an exception over-counts its tail,
 * which does not happen in ordinary user-mode code).
 *
 * Plugin API: QEMU's <qemu-plugin.h> is used when the compiler finds it; QEMU 9.0 and later
 * (API v2+) count per vCPU in a scoreboard, exact with any number of guest threads. Debian 12's
 * QEMU 7.2 exports the API (qemu-user accepts -plugin) but no package ships the header, so the
 * API-v1 declarations this file needs are written out below; there the inline add goes to one
 * counter shared by all vCPUs, exact for single-threaded guests (run pinfer with -t 1) and racy
 * otherwise (use inline=off).
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__has_include) && !defined(INSN_COUNT_OWN_DECLARATIONS)
#if __has_include(<qemu-plugin.h>)
#include <qemu-plugin.h>
#define HAVE_QEMU_PLUGIN_H 1
#endif
#endif

#ifndef HAVE_QEMU_PLUGIN_H
/* The parts of QEMU's plugin API version 1 (QEMU 4.2 to 8.2) that this plugin calls. */
#define QEMU_PLUGIN_EXPORT __attribute__((visibility("default")))
#define QEMU_PLUGIN_VERSION 1
typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t {
    const char *target_name;
    struct {
        int min;
        int cur;
    } version;
    bool system_emulation;
    union {
        struct {
            int smp_vcpus;
            int max_vcpus;
        } system;
    };
} qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS, QEMU_PLUGIN_CB_RW_REGS };
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
extern QEMU_PLUGIN_EXPORT int qemu_plugin_version;
QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                           char **argv);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
                                              void *ptr, uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
void qemu_plugin_outs(const char *string);
#endif

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

#if QEMU_PLUGIN_VERSION >= 2
#define PER_VCPU 1
static struct qemu_plugin_scoreboard *scoreboard; /* one uint64_t per vCPU */
#else
#define PER_VCPU 0
static uint64_t inline_count; /* API v1: one counter, added to by every vCPU without atomics */
#endif
static uint64_t callback_count; /* inline=off: atomic adds */
static bool use_inline = true;
static const char *out_path;

static void tb_exec(unsigned int vcpu_index, void *userdata)
{
    (void)vcpu_index;
    __atomic_fetch_add(&callback_count, (uint64_t)(uintptr_t)userdata, __ATOMIC_RELAXED);
}

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    size_t n = qemu_plugin_tb_n_insns(tb);
    if (!use_inline) {
        qemu_plugin_register_vcpu_tb_exec_cb(tb, tb_exec, QEMU_PLUGIN_CB_NO_REGS, (void *)(uintptr_t)n);
        return;
    }
#if PER_VCPU
    qemu_plugin_register_vcpu_tb_exec_inline_per_vcpu(tb, QEMU_PLUGIN_INLINE_ADD_U64,
                                                      qemu_plugin_scoreboard_u64(scoreboard), n);
#else
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &inline_count, n);
#endif
}

static void at_exit(qemu_plugin_id_t id, void *userdata)
{
    (void)id;
    (void)userdata;
    uint64_t total = __atomic_load_n(&callback_count, __ATOMIC_RELAXED);
#if PER_VCPU
    total += qemu_plugin_u64_sum(qemu_plugin_scoreboard_u64(scoreboard));
#else
    total += inline_count;
#endif
    char line[64];
    snprintf(line, sizeof line, "%" PRIu64 "\n", total);
    if (out_path) {
        FILE *f = fopen(out_path, "w");
        if (f && fputs(line, f) >= 0 && fclose(f) == 0) {
            return;
        }
        fprintf(stderr, "insn_count: cannot write %s\n", out_path);
    }
    fprintf(stderr, "insn_count: %s", line);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                           char **argv)
{
    (void)info;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        if (strncmp(arg, "out=", 4) == 0 && arg[4] != '\0') {
            out_path = arg + 4;
        } else if (strcmp(arg, "inline=off") == 0 || strcmp(arg, "inline=false") == 0) {
            use_inline = false;
        } else if (strcmp(arg, "inline=on") == 0 || strcmp(arg, "inline=true") == 0) {
            use_inline = true;
        } else {
            fprintf(stderr, "insn_count: unknown argument '%s' (use out=FILE, inline=on|off)\n", arg);
            return -1;
        }
    }
    if (out_path) {
        /* Fail now, not after a long run, if the file cannot be written; and never leave a stale
         * total from an earlier run in it. */
        FILE *f = fopen(out_path, "w");
        if (!f) {
            fprintf(stderr, "insn_count: cannot write %s\n", out_path);
            return -1;
        }
        fclose(f);
    }
#if PER_VCPU
    scoreboard = qemu_plugin_scoreboard_new(sizeof(uint64_t));
#endif
    qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
