//! The model's chat template (a Jinja template from `tokenizer.chat_template`), rendered the way
//! Hugging Face's `apply_chat_template` renders it.
//!
//! A prompt that differs from the training format by one newline changes the tokens the model
//! conditions on, and nothing fails: answers just get worse. So the environment copies HF's:
//! `trim_blocks` and `lstrip_blocks` on, no autoescaping, Python string methods (`.strip()`,
//! `.startswith()`, ...) through minijinja-contrib's pycompat, a `raise_exception` function, a
//! `strftime_now` (Llama 3.2+ and SmolLM3 print today's date), a `tojson` that prints like
//! Python's `json.dumps`, the variables `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`, and a request's `chat_template_kwargs` (Qwen3's `enable_thinking`). The template
//! is compiled once, at load, so a template minijinja cannot parse fails the model load, not the
//! first request.

use minijinja::value::Kwargs;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value, context};

/// One chat turn.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, in OpenAI's shape with `function.arguments` as a JSON object
    /// (as Hugging Face templates expect it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool turn: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: String, content: String) -> Self {
        ChatMessage { role, content, ..Default::default() }
    }
}

const NAME: &str = "chat_template";

/// A template that does not compile, or a conversation it rejects (`raise_exception`, a missing
/// variable): the message says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ChatTemplateError(String);

/// A compiled chat template. Immutable, `Send + Sync`: share it with `Arc`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    /// The template reads a `tools` variable (decided once: every chat request asks).
    renders_tools: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| strftime(chrono::Local::now().naive_local(), &format));
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned()).map_err(|e| ChatTemplateError(format!("{e:#}")))?;
        Ok(Self {
            env,
            source: source.to_owned(),
            renders_tools: source.contains("tools"),
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
        })
    }

    /// `strftime_now` answers with `now` instead of the clock: a render that does not change
    /// with the day (reference tests).
    pub fn with_now(mut self, now: chrono::NaiveDateTime) -> Self {
        self.env.add_function("strftime_now", move |format: String| strftime(now, &format));
        self
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The template renders function tools itself (it reads a `tools` variable).
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, add_generation_prompt, None, None)
    }

    /// [`ChatTemplate::render`] with `tools` (OpenAI's tool objects) and the request's
    /// `chat_template_kwargs` (e.g. Qwen3's `enable_thinking`) passed to the template, as HF's
    /// `apply_chat_template(..., **kwargs)` passes them. A kwarg may not be named like one of
    /// the variables set here ([`RESERVED_TEMPLATE_VARIABLES`]); callers check that first.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
        kwargs: Option<&TemplateKwargs>,
    ) -> Result<String, ChatTemplateError> {
        let template = self.env.get_template(NAME).map_err(|e| ChatTemplateError(format!("{e:#}")))?;
        // An absent special token is undefined in the template, as in HF (not the string "None").
        let token = |t: &Option<String>| t.as_deref().map_or(Value::UNDEFINED, Value::from);
        let ctx = context! {
            messages => messages,
            tools => tools.map_or(Value::UNDEFINED, Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => token(&self.bos_token),
            eos_token => token(&self.eos_token),
        };
        // Merged only when given: most requests carry none, and a merge builds a new map.
        let ctx = match kwargs {
            Some(kwargs) => context! { ..ctx, ..Value::from_serialize(kwargs) },
            None => ctx,
        };
        template.render(ctx).map_err(|e| ChatTemplateError(format!("rendering the chat template: {e:#}")))
    }
}

/// A request's extra template variables (vLLM's `chat_template_kwargs`).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// The variables the renderer sets itself: a kwarg of one of these names is refused, not
/// silently shadowed.
pub const RESERVED_TEMPLATE_VARIABLES: [&str; 5] =
    ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

/// Python's `datetime.strftime`, as HF's `strftime_now` calls it; a format chrono does not know
/// fails the render instead of panicking.
fn strftime(now: chrono::NaiveDateTime, format: &str) -> Result<Value, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", now.format(format))
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: unsupported format {format:?}")))?;
    Ok(Value::from(out))
}

/// HF templates call `raise_exception("...")` to reject a conversation (e.g. roles that do not
/// alternate); the message reaches the client as the error.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as HF defines it: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`, i.e.
/// `", "` and `": "` separators, no HTML escaping (minijinja's own escapes `<`, `>`, `&`, `'`).
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(i) => Some(i),
        None => indent,
    };
    let json =
        serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&spaces),
            );
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompact);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(Value::from_safe_string(text))
}

/// Python's default `json.dumps` separators.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's `tokenizer.chat_template`, verbatim from its GGUF.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role.into(), content.into())
    }

    fn smollm2() -> ChatTemplate {
        ChatTemplate::new(SMOLLM2, Some("<|im_start|>"), Some("<|im_end|>")).unwrap()
    }

    #[test]
    fn smollm2_chatml_without_system_message_gets_the_default_system_prompt() {
        let out = smollm2().render(&[msg("user", "Hi there")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi there<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn smollm2_chatml_with_system_message_and_no_generation_prompt() {
        let msgs = [msg("system", "Be brief."), msg("user", "2+2?"), msg("assistant", "4")];
        let out = smollm2().render(&msgs, false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n\
             <|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n"
        );
    }

    #[test]
    fn block_tags_on_their_own_lines_leave_no_whitespace_like_hf() {
        // trim_blocks + lstrip_blocks: the indented `{% ... %}` lines vanish entirely.
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(t.render(&[msg("user", "a"), msg("user", "b")], false).unwrap(), "U: a\nU: b\n");
    }

    #[test]
    fn python_string_methods_work_in_templates() {
        let src = "{% for m in messages %}{{ m.content.strip() }}|{{ m.role.startswith('us') }}|{{ m.content.split(',')[1] }}{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        // Booleans print as Python's `True`, as in Jinja2.
        assert_eq!(t.render(&[msg("user", "  x,y  ")], false).unwrap(), "x,y|True|y  ");
    }

    #[test]
    fn strftime_now_prints_the_pinned_date_as_python_would_and_refuses_an_unknown_format() {
        let now = chrono::NaiveDate::from_ymd_opt(2024, 7, 26).unwrap().and_hms_opt(9, 5, 0).unwrap();
        let t = ChatTemplate::new("Today Date: {{ strftime_now('%d %b %Y') }}", None, None).unwrap().with_now(now);
        assert_eq!(t.render(&[], false).unwrap(), "Today Date: 26 Jul 2024");
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", None, None).unwrap();
        assert!(bad.render(&[], false).unwrap_err().to_string().contains("unsupported format"));
    }

    #[test]
    fn chat_template_kwargs_reach_the_template_as_variables() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is defined and not enable_thinking %}off{% else %}on{% endif %}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "on");
        let off: TemplateKwargs = serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
        assert_eq!(t.render_with_tools(&[], false, None, Some(&off)).unwrap(), "off");
    }

    #[test]
    fn raise_exception_fails_the_render_with_the_templates_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(t.render(&[msg("user", "x")], false).unwrap(), "ok");
        let err = t.render(&[msg("assistant", "x")], false).unwrap_err().to_string();
        assert!(err.contains("Conversation must start with user"), "{err}");
    }

    #[test]
    fn bos_and_eos_tokens_are_template_variables() {
        let t = ChatTemplate::new("{{ bos_token }}x{{ eos_token }}", Some("<s>"), Some("</s>")).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "<s>x</s>");
        let t = ChatTemplate::new("{% if bos_token is defined %}B{% endif %}x", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "x");
    }

    #[test]
    fn tojson_prints_like_python_json_dumps_without_html_escaping() {
        let t = ChatTemplate::new("{{ [messages[0].content, 1, {'k': none}] | tojson }}", None, None).unwrap();
        assert_eq!(t.render(&[msg("user", "a<b & 'c' é\n")], false).unwrap(), r#"["a<b & 'c' é\n", 1, {"k": null}]"#);
        let t = ChatTemplate::new("{{ [1, 2] | tojson(indent=2) }}", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "[\n  1,\n  2\n]");
    }

    #[test]
    fn unparsable_template_fails_at_construction() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }

    #[test]
    fn tools_and_tool_calls_reach_a_template_that_renders_them() {
        let src = "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}\
                   {% for m in messages %}{{ m.role }}:{{ m.content }}\
                   {% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}|{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert!(t.renders_tools());
        let tools = [serde_json::json!({"type": "function", "function": {"name": "f"}})];
        let call =
            serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}});
        let msgs = [msg("user", "hi"), ChatMessage { tool_calls: vec![call], ..msg("assistant", "") }];
        assert_eq!(
            t.render_with_tools(&msgs, false, Some(&tools), None).unwrap(),
            "[f;]user:hi|assistant:<f {\"x\": 1}>|"
        );
        assert_eq!(t.render(&msgs[..1], false).unwrap(), "user:hi|", "no tools: the variable is undefined");
    }
}
