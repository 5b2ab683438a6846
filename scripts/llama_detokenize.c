/* llama.cpp's detokenizer for the WordPiece goldens (scripts/tokenizer_wpm_goldens.py): for each
 * line of token ids on stdin, prints llama_detokenize's text twice as hex, special tokens not
 * rendered and rendered (remove_special off both times), separated by a space.
 *
 * Usage: llama_detokenize VOCAB.gguf < IDS
 *
 * A tool for making committed goldens, never part of pinfer's build or CI. Built against
 * target/llama.cpp (L=target/llama.cpp/src/vendor/llama.cpp, B=target/llama.cpp/build):
 *   gcc -O2 -x c scripts/llama_detokenize.c -x none -I$L/include -I$L/ggml/include \
 *     -Wl,--start-group $B/src/libllama.a $B/ggml/src/libggml*.a -Wl,--end-group -lstdc++ -lm -lpthread */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void print_hex(const char *text, int n) {
    if (n == 0) putchar('-');
    for (int i = 0; i < n; i++) printf("%02x", (unsigned char)text[i]);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s VOCAB.gguf < IDS\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    static char line[1 << 16], text[1 << 16];
    static llama_token ids[1 << 14];
    while (fgets(line, sizeof line, stdin)) {
        int n = 0;
        for (char *p = strtok(line, " \n"); p && n < (int)(sizeof ids / sizeof ids[0]); p = strtok(NULL, " \n"))
            ids[n++] = atoi(p);
        for (int special = 0; special <= 1; special++) {
            int k = llama_detokenize(vocab, ids, n, text, sizeof text, false, special);
            if (k < 0) return 1;
            print_hex(text, k);
            putchar(special ? '\n' : ' ');
        }
    }
    llama_model_free(model);
    return 0;
}
