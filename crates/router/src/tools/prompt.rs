//! Tools and tool turns into the prompt.
//!
//! A chat template that renders tools itself (it reads a `tools` variable, as Qwen2.5's and
//! Llama 3.1's do) gets them, and the history as OpenAI sent it. A template without tool support
//! (ChatML, SmolLM2's) gets the Hermes tool prompt, the format Qwen2.5 was trained on: the tools
//! in a system turn, earlier calls as `<tool_call>` blocks in the assistant's text, and tool
//! results as `<tool_response>` blocks in a user turn. Either way the answer is parsed by the
//! family's parser, so what the model is shown and what is read back always agree.

use std::borrow::Cow;

use bellows_common::chat_template::ChatMessage;
use serde_json::Value;

use super::Tools;

/// The messages to render and the tools to pass the template (only when it renders them). A
/// conversation with no tool in it is rendered as sent, uncopied.
pub fn conversation<'a>(
    messages: &'a [ChatMessage],
    tools: Option<&Tools>,
    template_renders_tools: bool,
) -> (Cow<'a, [ChatMessage]>, Option<Vec<Value>>) {
    let active = tools.filter(|t| t.active());
    let tool_turns = messages.iter().any(|m| m.role == "tool" || !m.tool_calls.is_empty());
    if template_renders_tools || (active.is_none() && !tool_turns) {
        return (Cow::Borrowed(messages), active.map(Tools::as_json));
    }
    let mut out: Vec<ChatMessage> = messages.iter().map(hermes_turn).collect();
    if let Some(tools) = active {
        let block = hermes_tools(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" => first.content = format!("{}\n\n{block}", first.content),
            _ => out.insert(0, ChatMessage { role: "system".into(), content: block, ..Default::default() }),
        }
    }
    (Cow::Owned(out), None)
}

fn hermes_tools(tools: &Tools) -> String {
    let listed: Vec<String> = tools.as_json().iter().map(Value::to_string).collect();
    format!(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
         For each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
        listed.join("\n")
    )
}

/// One turn in Hermes' text form: calls as `<tool_call>` blocks, results as `<tool_response>`.
fn hermes_turn(m: &ChatMessage) -> ChatMessage {
    if m.role == "tool" {
        let content = format!("<tool_response>\n{}\n</tool_response>", m.content);
        return ChatMessage { role: "user".into(), content, ..Default::default() };
    }
    if m.tool_calls.is_empty() {
        return ChatMessage { role: m.role.clone(), content: m.content.clone(), ..Default::default() };
    }
    let calls: Vec<String> = m
        .tool_calls
        .iter()
        .map(|c| {
            let f = &c["function"];
            let call = serde_json::json!({"name": f["name"], "arguments": f["arguments"]});
            format!("<tool_call>\n{call}\n</tool_call>")
        })
        .collect();
    let content = if m.content.is_empty() { calls.join("\n") } else { format!("{}\n{}", m.content, calls.join("\n")) };
    ChatMessage { role: m.role.clone(), content, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tools::{ToolChoice, ToolSpec};

    fn tools(choice: ToolChoice) -> Tools {
        let spec = ToolSpec { name: "weather".into(), description: None, parameters: json!({"type": "object"}) };
        Tools { specs: vec![spec], choice, parallel: true }
    }

    fn history() -> Vec<ChatMessage> {
        let call = json!({"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}});
        vec![
            ChatMessage { role: "user".into(), content: "Weather in Paris?".into(), ..Default::default() },
            ChatMessage {
                role: "assistant".into(),
                content: String::new(),
                tool_calls: vec![call],
                tool_call_id: None,
            },
            ChatMessage {
                role: "tool".into(),
                content: "sunny".into(),
                tool_call_id: Some("call_1".into()),
                ..Default::default()
            },
        ]
    }

    #[test]
    fn without_template_support_tools_and_turns_take_hermes_form() {
        let history = history();
        let (msgs, passed) = conversation(&history, Some(&tools(ToolChoice::Auto)), false);
        assert_eq!(passed, None);
        assert_eq!(msgs[0].role, "system");
        let listed = msgs[0].content.split("<tools>\n").nth(1).and_then(|t| t.split("\n</tools>").next()).unwrap();
        assert_eq!(serde_json::from_str::<Value>(listed).unwrap()["function"]["name"], "weather");
        let call =
            msgs[2].content.strip_prefix("<tool_call>\n").and_then(|c| c.strip_suffix("\n</tool_call>")).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(call).unwrap(),
            json!({"name": "weather", "arguments": {"city": "Paris"}})
        );
        assert_eq!(
            (msgs[3].role.as_str(), msgs[3].content.as_str()),
            ("user", "<tool_response>\nsunny\n</tool_response>")
        );
    }

    #[test]
    fn a_template_with_tool_support_gets_the_tools_and_the_history_as_sent() {
        let history = history();
        let (msgs, passed) = conversation(&history, Some(&tools(ToolChoice::Required)), true);
        assert_eq!(*msgs, history);
        assert_eq!(passed.unwrap()[0]["function"]["name"], "weather");
    }

    #[test]
    fn tool_choice_none_shows_no_tools() {
        let history = history();
        let (msgs, passed) = conversation(&history[..1], Some(&tools(ToolChoice::None)), false);
        assert_eq!((msgs.len(), passed), (1, None));
    }
}
