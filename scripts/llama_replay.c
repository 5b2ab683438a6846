/* Replays prompts through llama.cpp's C API and writes every step's logits, so that a Python script
 * on the host can compare llama.cpp builds the host cannot load (scripts/llama_ref.py's arm_logits
 * runs an aarch64 build of this under qemu-aarch64 -cpu cortex-a76).
 *
 * Usage: llama_replay MODEL FLASH_ATTN(0|1) REPACK(0|1) THREADS OUT.f32 < PLAN
 * PLAN is text: the number of prompts, then per prompt a line "N_PROMPT N_FORCED N_STEPS" followed by
 * the prompt ids and the forced ids (whitespace-separated). The prompt is decoded as one batch; then
 * the forced ids are fed one by one, and once they run out each step feeds the argmax (greedy).
 * N_STEPS logits rows are written per prompt (the one after the prompt batch, then one per fed id),
 * as raw float32, n_vocab each. The greedy ids are printed on stdout, one prompt per line.
 * LLAMA_REPLAY_LORA=FILE[:SCALE] applies a LoRA adapter (llama_adapter_lora_init, scale 1 by default).
 *
 * Needs llama.cpp's headers and static libraries (build 0c1e570, as in tests/golden/README.md); it is a
 * tool for producing committed golden files, never part of pinfer's build or CI. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int read_ids(llama_token *ids, int n) {
    for (int i = 0; i < n; i++)
        if (scanf("%d", &ids[i]) != 1) return 0;
    return 1;
}

static int argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL FLASH_ATTN REPACK THREADS OUT.f32 < PLAN\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = atoi(argv[3]) != 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_threads = cp.n_threads_batch = atoi(argv[4]);
    cp.flash_attn_type = atoi(argv[2]) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const char *lora = getenv("LLAMA_REPLAY_LORA");
    if (lora && *lora) {
        char path[4096];
        float scale = 1.0f;
        snprintf(path, sizeof path, "%s", lora);
        char *colon = strrchr(path, ':');
        if (colon) { scale = (float)atof(colon + 1); *colon = 0; }
        struct llama_adapter_lora *adapter = llama_adapter_lora_init(model, path);
        if (!adapter) { fprintf(stderr, "cannot load the adapter %s\n", path); return 1; }
        if (llama_set_adapters_lora(ctx, &adapter, 1, &scale) != 0) {
            fprintf(stderr, "cannot apply the adapter %s\n", path);
            return 1;
        }
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[5], "wb");
    if (!out) { fprintf(stderr, "cannot write %s\n", argv[5]); return 1; }

    int n_prompts = 0;
    if (scanf("%d", &n_prompts) != 1) { fprintf(stderr, "bad plan\n"); return 1; }
    for (int p = 0; p < n_prompts; p++) {
        int n_prompt, n_forced, n_steps;
        if (scanf("%d %d %d", &n_prompt, &n_forced, &n_steps) != 3 || n_prompt < 1 || n_forced < 0 ||
            n_steps < 1 || n_prompt + n_steps > 256) {
            fprintf(stderr, "bad plan at prompt %d\n", p);
            return 1;
        }
        llama_token *prompt = malloc(sizeof(llama_token) * n_prompt);
        llama_token *forced = malloc(sizeof(llama_token) * (n_forced + 1));
        if (!prompt || !forced) { fprintf(stderr, "out of memory\n"); return 1; }
        if (!read_ids(prompt, n_prompt) || !read_ids(forced, n_forced)) {
            fprintf(stderr, "bad ids at prompt %d\n", p);
            return 1;
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_token *feed = prompt;
        int n_feed = n_prompt;
        llama_token one; /* the single id fed after the prompt (llama_decode is synchronous) */
        for (int step = 0; step < n_steps; step++) {
            if (llama_decode(ctx, llama_batch_get_one(feed, n_feed)) != 0) {
                fprintf(stderr, "decode failed at prompt %d step %d\n", p, step);
                return 1;
            }
            const float *logits = llama_get_logits_ith(ctx, -1);
            if (!logits || fwrite(logits, sizeof(float), n_vocab, out) != (size_t)n_vocab) {
                fprintf(stderr, "no logits written at prompt %d step %d\n", p, step);
                return 1;
            }
            int next = argmax(logits, n_vocab);
            printf("%d ", next);
            one = step < n_forced ? forced[step] : next;
            feed = &one;
            n_feed = 1;
        }
        printf("\n");
        free(prompt);
        free(forced);
    }
    if (fclose(out) != 0) { fprintf(stderr, "cannot write %s\n", argv[5]); return 1; }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
