// llama.cpp's reading of a model's reply, for the tool-call goldens (scripts/tool_call_goldens.py):
// the chat template's format as llama.cpp's `common/chat` detects it with tools present
// (common_chat_templates_apply), then common_chat_parse of each reply (whole, not partial), as
// llama-server parses a finished reply with `--reasoning-format deepseek`.
//
//   llama_chat_parse TEMPLATE.jinja < cases.json
//
// cases.json: {"tools": [OpenAI tools], "replies": ["...", ...], "enable_thinking": true, "bos": "",
// "eos": ""} (the special tokens default to none, as in llama.cpp's tests/test-chat.cpp)
// Prints one JSON object: {"format": NAME, "parses": [{"content", "reasoning_content",
// "tool_calls": [{"name", "arguments", "id"}]} or {"error": MESSAGE}, ...]}.
//
// Built by scripts/llama_chat_parse.sh against the llama.cpp build of scripts/llama_cpp_build.sh.
// A reference tool only: never part of pinfer or of its CI.
#include "chat.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <sstream>

using json = nlohmann::ordered_json;

int main(int argc, char ** argv) {
    if (argc != 2) {
        std::cerr << "usage: llama_chat_parse TEMPLATE.jinja < cases.json\n";
        return 2;
    }
    std::ifstream file(argv[1]);
    std::stringstream source;
    source << file.rdbuf();
    json cases = json::parse(std::cin);

    auto templates = common_chat_templates_init(nullptr, source.str(), cases.value("bos", ""), cases.value("eos", ""));
    common_chat_templates_inputs inputs;
    common_chat_msg user;
    user.role    = "user";
    user.content = "What is the weather in Paris?";
    inputs.messages            = { user };
    inputs.tools               = common_chat_tools_parse_oaicompat(common_json::parse(cases.at("tools").dump()));
    inputs.parallel_tool_calls = true;
    inputs.reasoning_format    = COMMON_REASONING_FORMAT_DEEPSEEK;
    inputs.enable_thinking     = cases.value("enable_thinking", true);
    auto params = common_chat_templates_apply(templates.get(), inputs);

    common_chat_parser_params parser(params);
    parser.reasoning_format = COMMON_REASONING_FORMAT_DEEPSEEK;
    if (!params.parser.empty()) {
        parser.parser.load(params.parser);
    }

    json out;
    out["format"]            = common_chat_format_name(params.format);
    out["generation_prompt"] = params.generation_prompt;
    json parses = json::array();
    for (const auto & reply : cases.at("replies")) {
        try {
            auto msg   = common_chat_parse(reply.get<std::string>(), false, parser);
            json calls = json::array();
            for (const auto & c : msg.tool_calls) {
                json call;
                call["name"]      = c.name;
                call["arguments"] = c.arguments;
                call["id"]        = c.id;
                calls.push_back(call);
            }
            json parse;
            parse["content"]           = msg.content;
            parse["reasoning_content"] = msg.reasoning_content;
            parse["tool_calls"]        = calls;
            parses.push_back(parse);
        } catch (const std::exception & e) {
            json error;
            error["error"] = e.what();
            parses.push_back(error);
        }
    }
    out["parses"] = parses;
    std::cout << out.dump(2) << "\n";
    return 0;
}
