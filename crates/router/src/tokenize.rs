//! Prompt text to token ids, the way the model's workers would do it, off the async runtime.
//!
//! The router tokenizes (architecture.md): it needs exact token counts for context checks and
//! rate limits, and the prompt's block hashes for placement. Tokenizing a long prompt takes
//! milliseconds of CPU; on an async worker thread that would stall every other connection it
//! serves, so it runs on a fixed pool of threads behind a bounded queue. When the queue is full
//! the request is refused at once (503): an unbounded queue would only turn overload into
//! timeouts, with memory growing all the while.

use std::{
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex,
        mpsc::{Receiver, SyncSender, TrySendError, sync_channel},
    },
};

use anyhow::Context;
use bellows_common::chat_template::{ChatMessage, ChatTemplate, TemplateKwargs};

use crate::tools::{self, Tools};
use bellows_proto::worker::v1 as pb;
use tokio::sync::oneshot;
use xxhash_rust::xxh3::xxh3_64;

type Task = Box<dyn FnOnce() + Send>;

/// The tokenizer threads and their bounded queue.
pub struct TokenizerPool {
    tx: SyncSender<Task>,
}

/// Every thread is busy and the queue is full (or the pool is gone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolBusy;

impl TokenizerPool {
    pub fn new(threads: usize, queue: usize) -> Self {
        let (tx, rx) = sync_channel::<Task>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("tokenizer-{i}"))
                .spawn(move || run_tasks(&rx))
                .expect("spawning a tokenizer thread");
        }
        Self { tx }
    }

    /// Run `f` on a pool thread. It is queued (or refused, when the queue is full) at the call,
    /// not when the returned future is first polled.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = Result<T, PoolBusy>> + 'static {
        let (done, result) = oneshot::channel();
        let task: Task = Box::new(move || {
            // A panic (a tokenizer bug on odd input) fails this request only, not the thread.
            if let Ok(v) = std::panic::catch_unwind(AssertUnwindSafe(f)) {
                let _ = done.send(v);
            }
        });
        let queued = match self.tx.try_send(task) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        };
        async move {
            if !queued {
                return Err(PoolBusy);
            }
            result.await.map_err(|_| PoolBusy)
        }
    }
}

fn run_tasks(rx: &Mutex<Receiver<Task>>) {
    loop {
        let task = match rx.lock().expect("tokenizer queue lock").recv() {
            Ok(task) => task,
            Err(_) => return,
        };
        task();
    }
}

/// A model's tokenizer and chat template, built from a worker's ModelInfo: one per model,
/// shared by all its workers.
pub enum PromptTokenizer {
    /// The model's own tokenizer (tokenizer.json from the worker) and chat template.
    Model { tokenizer: Box<tokenizers::Tokenizer>, template: Option<Box<ChatTemplate>> },
    /// The simulated engine has no tokenizer: words become ids the way the simulated vocabulary
    /// spells them (`t17` is token 17, so a sim completion fed back is the same tokens), and any
    /// other word a hash into the vocabulary, so equal texts give equal tokens.
    Sim { vocab_size: u32 },
}

impl PromptTokenizer {
    pub fn from_model_info(info: &pb::ModelInfoResponse) -> anyhow::Result<Self> {
        if info.tokenizer_json.is_empty() {
            anyhow::ensure!(info.vocab_size > 1, "ModelInfo has neither a tokenizer nor a vocabulary size");
            return Ok(PromptTokenizer::Sim { vocab_size: info.vocab_size });
        }
        let tokenizer = tokenizers::Tokenizer::from_bytes(&info.tokenizer_json)
            .map_err(|e| anyhow::anyhow!("the worker's tokenizer.json does not load: {e}"))?;
        let text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i));
        let bos = text(info.bos_token_id);
        let eos = text(info.eos_token_ids.first().copied());
        let template = info
            .chat_template
            .as_deref()
            .map(|src| ChatTemplate::new(src, bos.as_deref(), eos.as_deref()).map(Box::new))
            .transpose()
            .context("the worker's chat template does not compile")?;
        Ok(PromptTokenizer::Model { tokenizer: Box::new(tokenizer), template })
    }

    /// The model's chat template, if it has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        match self {
            PromptTokenizer::Model { template, .. } => template.as_deref(),
            PromptTokenizer::Sim { .. } => None,
        }
    }

    /// Render the conversation with the chat template (ending with the assistant's turn) and
    /// tokenize it; the template writes any BOS itself. Tools reach the prompt as
    /// [`tools::prompt`] decides; `kwargs` are the request's extra template variables.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Tools>,
        kwargs: Option<&TemplateKwargs>,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.encode_chat_with(messages, tools, kwargs, ChatEncoding::GENERATE)
    }

    /// [`PromptTokenizer::encode_chat`] with the rendering's choices made by the caller (what
    /// `/v1/tokenize` lets a client choose).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Tools>,
        kwargs: Option<&TemplateKwargs>,
        how: ChatEncoding,
    ) -> Result<Vec<u32>, TokenizeError> {
        let renders_tools = self.template().is_some_and(ChatTemplate::renders_tools);
        let (messages, tools) = tools::prompt::conversation(messages, tools, renders_tools);
        let messages: &[ChatMessage] = &messages;
        match self {
            PromptTokenizer::Model { template: Some(t), tokenizer } => {
                let text = t
                    .render_with_tools(messages, how.add_generation_prompt, tools.as_deref(), kwargs)
                    .map_err(|e| TokenizeError::Template(e.to_string()))?;
                encode(tokenizer, &text, how.add_special_tokens)
            }
            PromptTokenizer::Model { template: None, .. } => Err(TokenizeError::NoChatTemplate),
            PromptTokenizer::Sim { vocab_size } => {
                let text: String = messages.iter().map(|m| format!("{} {}\n", m.role, m.content)).collect();
                Ok(sim_encode(&text, *vocab_size))
            }
        }
    }

    /// Tokenize a completion prompt, with BOS when the model wants one.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_text_with(text, true)
    }

    /// Tokenize text, with the model's special tokens (BOS) only if `add_special_tokens`.
    pub fn encode_text_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match self {
            PromptTokenizer::Model { tokenizer, .. } => encode(tokenizer, text, add_special_tokens),
            PromptTokenizer::Sim { vocab_size } => Ok(sim_encode(text, *vocab_size)),
        }
    }

    /// The text of token ids (control tokens written out, as in the prompt they came from). The
    /// ids must be within the vocabulary: the caller checks them against it.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        match self {
            PromptTokenizer::Model { tokenizer, .. } => {
                tokenizer.decode(ids, false).map_err(|e| TokenizeError::Encode(e.to_string()))
            }
            PromptTokenizer::Sim { .. } => Ok(ids.iter().map(|&id| sim_token(id)).collect::<Vec<_>>().join(" ")),
        }
    }

    /// The id of a token spelled `text`, when the vocabulary has it as one token.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match self {
            PromptTokenizer::Model { tokenizer, .. } => tokenizer.token_to_id(text),
            PromptTokenizer::Sim { .. } => None,
        }
    }

    /// Each id's token as the vocabulary spells it (byte-level BPE's `Ġ` for a space, for one).
    pub fn token_strs(&self, ids: &[u32]) -> Vec<String> {
        match self {
            PromptTokenizer::Model { tokenizer, .. } => {
                ids.iter().map(|&id| tokenizer.id_to_token(id).unwrap_or_default()).collect()
            }
            PromptTokenizer::Sim { .. } => ids.iter().map(|&id| sim_token(id)).collect(),
        }
    }
}

/// How a conversation is rendered into tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatEncoding {
    /// End with the template's opening of the assistant's turn.
    pub add_generation_prompt: bool,
    /// Let the tokenizer add its special tokens too (the template usually writes BOS itself).
    pub add_special_tokens: bool,
}

impl ChatEncoding {
    /// What a generation renders.
    pub const GENERATE: ChatEncoding = ChatEncoding { add_generation_prompt: true, add_special_tokens: false };
}

/// Why a prompt could not become token ids (the HTTP layer decides what a client sees).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// The chat template rejected the conversation, or could not render it.
    #[error("{0}")]
    Template(String),
    #[error("this model has no chat template; use /v1/completions with a prompt")]
    NoChatTemplate,
    #[error("the prompt could not be tokenized: {0}")]
    Encode(String),
}

fn encode(tokenizer: &tokenizers::Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
    tokenizer
        .encode_fast(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| TokenizeError::Encode(e.to_string()))
}

/// The simulated vocabulary's spelling of a token, which [`sim_encode`] reads back as that id.
fn sim_token(id: u32) -> String {
    format!("t{id}")
}

fn sim_encode(text: &str, vocab_size: u32) -> Vec<u32> {
    text.split_whitespace()
        .map(|word| {
            match word.strip_prefix('t').and_then(|n| n.parse::<u32>().ok()) {
                Some(id) if id > 0 && id < vocab_size => id,
                // Never 0: that is the simulated EOS.
                _ => 1 + (xxh3_64(word.as_bytes()) % u64::from(vocab_size - 1)) as u32,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_instead_of_waiting() {
        let pool = TokenizerPool::new(1, 1);
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let blocked = Mutex::new(blocked);
        // One task occupies the thread, one fills the queue.
        let running = tokio::spawn(pool.run(move || blocked.lock().unwrap().recv().ok()));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let queued = tokio::spawn(pool.run(|| 1));
        assert_eq!(pool.run(|| 2).await, Err(PoolBusy));
        release.send(()).unwrap();
        assert!(running.await.unwrap().is_ok());
        assert_eq!(queued.await.unwrap(), Ok(1));
        assert_eq!(pool.run(|| 3).await, Ok(3), "the pool serves again once drained");
    }

    #[tokio::test]
    async fn a_panicking_task_fails_alone_and_the_thread_survives() {
        let pool = TokenizerPool::new(1, 4);
        assert_eq!(pool.run(|| -> u32 { panic!("tokenizer bug") }).await, Err(PoolBusy));
        assert_eq!(pool.run(|| 7).await, Ok(7));
    }

    #[test]
    fn sim_text_spells_its_token_ids() {
        let t = PromptTokenizer::Sim { vocab_size: 1000 };
        assert_eq!(t.encode_text(" t5 t17 t999").unwrap(), vec![5, 17, 999]);
        let a = t.encode_text("hello world").unwrap();
        assert_eq!(a, t.encode_text("hello  world").unwrap());
        assert!(a.iter().all(|&i| i > 0 && i < 1000));
    }

    #[test]
    fn sim_ids_decode_to_text_that_encodes_back_to_them() {
        let t = PromptTokenizer::Sim { vocab_size: 1000 };
        let ids = t.encode_text("hello t5 world").unwrap();
        let text = t.decode(&ids).unwrap();
        assert_eq!(t.encode_text(&text).unwrap(), ids);
        assert_eq!(t.token_strs(&[5, 17]), ["t5", "t17"]);
    }
}
