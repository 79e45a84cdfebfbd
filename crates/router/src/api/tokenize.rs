//! `/v1/tokenize` and `/v1/detokenize` (also at vLLM's `/tokenize` and `/detokenize`), in
//! vLLM's shape: a prompt or a conversation (rendered by the chat template, as a generation
//! would render it unless told otherwise) to token ids, and ids back to text.
//!
//! They run on the router's own tokenizer, the one that counts and places every request, so
//! what they say is what a generation is charged and what the workers are sent; no worker is
//! asked. Each key may tokenize only with the models it may use.

use std::sync::Arc;

use axum::{
    Json,
    body::{Body, Bytes},
    extract::State,
    http::HeaderMap,
    response::{IntoResponse, Response},
};
use bellows_common::chat_template::TemplateKwargs;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    AppState,
    completions::{self, authorization},
    error::ApiError,
    request::{self, Input, RawMessage, deserialize},
    tool_request,
};
use crate::{
    cluster::pool::ModelPool,
    tenants::{LimitError, Tenant},
    tokenize::ChatEncoding,
};

#[derive(Debug, Deserialize)]
struct RawTokenize {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<RawMessage>>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    add_special_tokens: Option<bool>,
    return_token_strs: Option<bool>,
    chat_template_kwargs: Option<TemplateKwargs>,
}

#[derive(Debug, Deserialize)]
struct RawDetokenize {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

pub async fn tokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match run_tokenize(&state, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn detokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match run_detokenize(&state, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn run_tokenize(state: &Arc<AppState>, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let (tenant, bytes) = authenticated_body(state, headers, body).await?;
    let raw: RawTokenize = deserialize(&bytes)?;
    let pool = tenant_model(state, &tenant, raw.model.as_deref())?;
    let strs = raw.return_token_strs.unwrap_or(false);
    let what = tokenize_input(raw)?;
    let tokenizer = pool.tokenizer.clone();
    let ids = state
        .tokenizers
        .run(move || match what {
            ToTokenize::Text { text, add_special_tokens } => tokenizer.encode_text_with(&text, add_special_tokens),
            ToTokenize::Chat { input, tools, kwargs, how } => {
                let Input::Chat(messages) = input else { unreachable!("a conversation is a chat") };
                tokenizer.encode_chat_with(&messages, tools.as_ref(), kwargs.as_ref(), how)
            }
        })
        .await
        .map_err(|_| completions::tokenizer_busy())??;
    let token_strs = strs.then(|| pool.tokenizer.token_strs(&ids));
    Ok(json!({
        "count": ids.len(),
        "max_model_len": pool.context_length(),
        "tokens": ids,
        "token_strs": token_strs,
    }))
}

async fn run_detokenize(state: &Arc<AppState>, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let (tenant, bytes) = authenticated_body(state, headers, body).await?;
    let raw: RawDetokenize = deserialize(&bytes)?;
    let tokens = raw.tokens.ok_or_else(|| ApiError::invalid("tokens", "'tokens' is required"))?;
    let pool = tenant_model(state, &tenant, raw.model.as_deref())?;
    if let Some(i) = tokens.iter().position(|&t| t >= pool.vocab_size) {
        return Err(ApiError::invalid(
            format!("tokens[{i}]"),
            format!("token id {} is outside the vocabulary (0 to {})", tokens[i], pool.vocab_size - 1),
        ));
    }
    let tokenizer = pool.tokenizer.clone();
    let text =
        state.tokenizers.run(move || tokenizer.decode(&tokens)).await.map_err(|_| completions::tokenizer_busy())??;
    Ok(json!({ "prompt": text }))
}

/// What a tokenize body asks to tokenize: exactly one of `prompt` and `messages`.
enum ToTokenize {
    Text { text: String, add_special_tokens: bool },
    Chat { input: Input, tools: Option<crate::tools::Tools>, kwargs: Option<TemplateKwargs>, how: ChatEncoding },
}

fn tokenize_input(raw: RawTokenize) -> Result<ToTokenize, ApiError> {
    match (raw.prompt, raw.messages) {
        (Some(text), None) => {
            for (set, field) in [
                (raw.tools.is_some(), "tools"),
                (raw.add_generation_prompt.is_some(), "add_generation_prompt"),
                (raw.chat_template_kwargs.is_some(), "chat_template_kwargs"),
            ] {
                if set {
                    return Err(ApiError::invalid(
                        field,
                        format!("'{field}' is for a tokenize request with 'messages'"),
                    ));
                }
            }
            Ok(ToTokenize::Text { text, add_special_tokens: raw.add_special_tokens.unwrap_or(true) })
        }
        (None, Some(messages)) => {
            if raw.continue_final_message == Some(true) {
                return Err(ApiError::invalid(
                    "continue_final_message",
                    "'continue_final_message' is not supported yet; the conversation is rendered whole",
                ));
            }
            let input = Input::Chat(request::chat_messages(messages)?);
            let kwargs = request::chat_template_kwargs(&input, raw.chat_template_kwargs)?;
            let tools = tool_request::parse(raw.tools, None, None)?;
            let how = ChatEncoding {
                add_generation_prompt: raw.add_generation_prompt.unwrap_or(true),
                add_special_tokens: raw.add_special_tokens.unwrap_or(false),
            };
            Ok(ToTokenize::Chat { input, tools, kwargs, how })
        }
        _ => Err(ApiError::invalid("prompt", "exactly one of 'prompt' and 'messages' is required")),
    }
}

/// The caller's tenant and its body, read within the size limit: the first steps of every
/// route that uses a model's tokenizer without generating.
pub(super) async fn authenticated_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Arc<Tenant>, Bytes), ApiError> {
    let tenant = state.tenants.authenticate(authorization(headers).as_deref()).map_err(|_| ApiError::Unauthorized)?;
    let bytes = completions::read_body(state, headers, body).await?;
    Ok((tenant, bytes))
}

/// The model a body names, which the tenant must be allowed to use; a body that names none
/// means the cluster's one model, if it serves only one (vLLM's requests may leave it out).
pub(super) fn tenant_model(state: &AppState, tenant: &Tenant, model: Option<&str>) -> Result<Arc<ModelPool>, ApiError> {
    let pool = match model {
        Some(name) => state.cluster.model(name).ok_or_else(|| ApiError::ModelNotFound(name.to_string()))?,
        None => match state.cluster.models().as_slice() {
            [only] => only.clone(),
            _ => {
                return Err(ApiError::invalid(
                    "model",
                    "'model' is required unless the cluster serves exactly one model",
                ));
            }
        },
    };
    if !tenant.allows_model(&pool.name) {
        return Err(ApiError::Limited(LimitError::ModelNotAllowed { model: pool.name.clone() }));
    }
    Ok(pool)
}
