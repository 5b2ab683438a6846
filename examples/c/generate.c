/* Greedy (or sampled) generation through pinfer's C ABI.
 *
 *   generate MODEL PROMPT [N] [TEMPERATURE]
 *
 * Generates one token a call (pinfer_generate_step: UTF-8-safe pieces, end-of-generation), prints
 * the text on stdout as it comes and the generated token ids on stderr ("ids: ..."), as
 * capi/tests/c_abi.rs checks them against llama.cpp's golden ids and the text against
 * `pinfer generate --temp 0`. Build (tests do it with cc):
 *   cargo build --release -p pinfer-capi
 *   cc -O2 -Iinclude examples/c/generate.c target/release/libpinfer_capi.a -lpthread -ldl -lm -o generate */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pinfer.h"

static char err[512];

#define CHECK(call)                                                        \
    do {                                                                   \
        pinfer_status s_ = (call);                                         \
        if (s_ != PINFER_OK) {                                             \
            fprintf(stderr, "generate: %s: status %d: %s\n", #call, s_, err); \
            return 1;                                                      \
        }                                                                  \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL PROMPT [N] [TEMPERATURE]\n", argv[0]);
        return 2;
    }
    const char *prompt = argv[2];
    int n_predict = argc > 3 ? atoi(argv[3]) : 32;
    float temperature = argc > 4 ? (float)atof(argv[4]) : 0.0f;

    pinfer_model *model = NULL;
    CHECK(pinfer_model_open_file(argv[1], &model, err, sizeof err));
    pinfer_model_info info;
    CHECK(pinfer_model_get_info(model, &info, err, sizeof err));

    pinfer_context_params cp;
    CHECK(pinfer_context_default_params(&cp, err, sizeof err));
    cp.n_ctx = 512;
    size_t bytes = 0;
    CHECK(pinfer_plan(model, &cp, &bytes, err, sizeof err));
    fprintf(stderr, "%s: %u layers, %u tokens; a context of %u takes %.1f MiB\n", info.arch, info.n_layer,
            info.n_vocab, cp.n_ctx, bytes / 1048576.0);
    pinfer_context *ctx = NULL;
    CHECK(pinfer_context_new(model, &cp, &ctx, err, sizeof err));

    uint32_t tokens[512];
    size_t n_prompt = 0;
    CHECK(pinfer_tokenize(model, prompt, strlen(prompt), 1, 1, tokens, 512, &n_prompt, err, sizeof err));
    CHECK(pinfer_decode(ctx, tokens, n_prompt, err, sizeof err));

    pinfer_sampler_params sp;
    CHECK(pinfer_sampler_default_params(&sp, err, sizeof err));
    sp.temperature = temperature;
    CHECK(pinfer_generate_begin(ctx, &sp, NULL, 0, err, sizeof err));

    /* One token a step: its text is whole UTF-8 characters, printed as it comes. */
    uint32_t generated[512];
    int n = 0;
    pinfer_end end = PINFER_END_NONE;
    while (n < n_predict && n < 512) {
        char piece[256];
        size_t len = 0;
        uint32_t token = 0;
        CHECK(pinfer_generate_step(ctx, &token, piece, sizeof piece, &len, &end, err, sizeof err));
        fwrite(piece, 1, len, stdout);
        if (token != UINT32_MAX) generated[n++] = token;
        if (end != PINFER_END_NONE) break;
    }
    if (end == PINFER_END_NONE) {
        /* Stopped here, not by the model: the text held back (part of a character) comes last. */
        char rest[256];
        size_t len = 0;
        CHECK(pinfer_generate_finish(ctx, rest, sizeof rest, &len, err, sizeof err));
        fwrite(rest, 1, len, stdout);
    }
    putchar('\n');
    fprintf(stderr, "ids:");
    for (int i = 0; i < n; i++) fprintf(stderr, " %u", generated[i]);
    fprintf(stderr, "\n");

    CHECK(pinfer_context_free(ctx, err, sizeof err));
    CHECK(pinfer_model_free(model, err, sizeof err));
    return 0;
}
