/*
 * insn_profile: a QEMU TCG plugin that attributes the guest instructions a program executes to
 * the symbol of each translation block's first instruction (inlined code counts for its caller),
 * and prints the symbols by instructions at exit: where insn_count's total goes.
 *
 *   gcc -O2 -shared -fPIC -o insn_profile.so insn_profile.c
 *   qemu-aarch64 -cpu cortex-a76 -plugin ./insn_profile.so,out=FILE ./program ...
 *
 * Every translation gets its own counter (an inline add of 1 per execution); at exit the counts
 * times the block lengths are summed per symbol. Single-threaded guests only (pinfer -t 1): the
 * inline adds are not atomic. Written against QEMU's plugin API version 1 (Debian 12's QEMU 7.2,
 * which ships no <qemu-plugin.h>), like insn_count.c.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QEMU_PLUGIN_EXPORT __attribute__((visibility("default")))
typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                           char **argv);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
                                              void *ptr, uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const char *qemu_plugin_insn_symbol(const struct qemu_plugin_insn *insn);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

QEMU_PLUGIN_EXPORT int qemu_plugin_version = 1;

/* One per translation: blocks are allocated once and never freed (the guest is short-lived). */
struct block {
    uint64_t execs;
    uint64_t n_insns;
    const char *symbol;
    struct block *next;
};
static struct block *blocks;
static const char *out_path;

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    struct block *b = calloc(1, sizeof *b);
    if (!b) {
        return;
    }
    b->n_insns = qemu_plugin_tb_n_insns(tb);
    const char *sym = b->n_insns ? qemu_plugin_insn_symbol(qemu_plugin_tb_get_insn(tb, 0)) : NULL;
    b->symbol = sym ? sym : "?";
    b->next = blocks;
    blocks = b;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &b->execs, 1);
}

struct total {
    const char *symbol;
    uint64_t insns;
};

static int by_insns(const void *a, const void *b)
{
    uint64_t x = ((const struct total *)a)->insns, y = ((const struct total *)b)->insns;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void at_exit(qemu_plugin_id_t id, void *userdata)
{
    (void)id;
    (void)userdata;
    size_t n = 0, cap = 1024;
    struct total *t = malloc(cap * sizeof *t);
    for (struct block *b = blocks; b && t; b = b->next) {
        size_t i = 0;
        while (i < n && strcmp(t[i].symbol, b->symbol) != 0) {
            i++;
        }
        if (i == n) {
            if (n == cap) {
                struct total *grown = realloc(t, 2 * cap * sizeof *t);
                if (!grown) {
                    break;
                }
                t = grown;
                cap *= 2;
            }
            t[n++] = (struct total){b->symbol, 0};
        }
        t[i].insns += b->execs * b->n_insns;
    }
    if (!t) {
        return;
    }
    qsort(t, n, sizeof *t, by_insns);
    FILE *f = out_path ? fopen(out_path, "w") : stderr;
    if (!f) {
        fprintf(stderr, "insn_profile: cannot write %s\n", out_path);
        f = stderr;
    }
    for (size_t i = 0; i < n; i++) {
        fprintf(f, "%" PRIu64 " %s\n", t[i].insns, t[i].symbol);
    }
    if (f != stderr) {
        fclose(f);
    }
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                           char **argv)
{
    (void)info;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0 && argv[i][4] != '\0') {
            out_path = argv[i] + 4;
        } else {
            fprintf(stderr, "insn_profile: unknown argument '%s' (use out=FILE)\n", argv[i]);
            return -1;
        }
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
