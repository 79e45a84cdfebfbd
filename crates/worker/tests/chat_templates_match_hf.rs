//! Published models' chat templates (Llama 3.1-3.3, Mistral Nemo and Small 3.2, Qwen2.5, Qwen3,
//! DeepSeek-R1, Gemma 2, SmolLM3, Phi-3.5, Hermes 3) rendered by our environment and by Hugging
//! Face's.
//!
//! A prompt one newline away from the training format changes what the model conditions on and
//! fails nowhere, so the reference is transformers' own environment (Jinja2 with its globals and
//! filters), recorded by `scripts/reference/chat_templates.py` in
//! `tests/fixtures/chat_template_reference.json`: for each template and conversation, the prompt
//! or the template's refusal. The templates come from llama.cpp's sources
//! (`scripts/fetch-model.sh llama-cpp-vocabs`).

use bellows_common::chat_template::ChatTemplate;
use bellows_worker::tokenizer::ChatMessage;
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    /// What `strftime_now` answered.
    date: String,
    bos_token: String,
    eos_token: String,
    conversations: Vec<Conversation>,
    renders: Vec<Render>,
}

#[derive(Deserialize)]
struct Conversation {
    name: String,
    messages: Vec<ChatMessage>,
    tools: Option<Vec<serde_json::Value>>,
    add_generation_prompt: bool,
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

/// One template on one conversation: the prompt, or the template's `raise_exception` message.
#[derive(Deserialize)]
struct Render {
    template: String,
    conversation: String,
    prompt: Option<String>,
    error: Option<String>,
}

fn template(reference: &Reference, file: &str) -> ChatTemplate {
    let path = bellows_worker::load::cached_model_path(&format!("llama-cpp-0.3.36-vocabs/templates/{file}"));
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("cannot read {} ({e}): run scripts/fetch-model.sh llama-cpp-vocabs", path.display())
    });
    let now = chrono::NaiveDateTime::parse_from_str(&reference.date, "%Y-%m-%dT%H:%M:%S").expect("the fixture's date");
    ChatTemplate::new(&source, Some(&reference.bos_token), Some(&reference.eos_token))
        .unwrap_or_else(|e| panic!("{file} does not compile: {e}"))
        .with_now(now)
}

#[test]
fn published_chat_templates_render_every_conversation_as_hugging_face_does() {
    let reference: Reference = serde_json::from_str(include_str!("fixtures/chat_template_reference.json")).unwrap();
    assert!(reference.renders.len() >= 72, "the fixture holds every template's renders");
    let mut mismatches = Vec::new();
    for render in &reference.renders {
        let conv = reference.conversations.iter().find(|c| c.name == render.conversation).unwrap();
        let ours = template(&reference, &render.template).render_with_tools(
            &conv.messages,
            conv.add_generation_prompt,
            conv.tools.as_deref(),
            conv.chat_template_kwargs.as_ref(),
        );
        let same = match (&ours, &render.prompt, &render.error) {
            (Ok(prompt), Some(want), None) => prompt == want,
            (Err(e), None, Some(why)) => e.to_string().contains(why.as_str()),
            _ => false,
        };
        if !same {
            let want = render.prompt.as_deref().or(render.error.as_deref()).unwrap_or_default();
            mismatches.push(format!(
                "{} on {}:\n  Hugging Face: {want:?}\n  ours:         {ours:?}",
                render.template, render.conversation
            ));
        }
    }
    assert!(mismatches.is_empty(), "{} renders differ:\n{}", mismatches.len(), mismatches.join("\n"));
}
