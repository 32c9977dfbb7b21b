//! The tokenizer, rebuilt from the GGUF's own metadata with the `tokenizers` crate.
//!
//! `tokenizer.ggml.model = "gpt2"` is a byte-level BPE: `tokenizer.ggml.tokens` is the
//! vocabulary (ids are positions), `tokenizer.ggml.merges` the merge rules ("a b"), and
//! `tokenizer.ggml.token_type` marks control / user-defined tokens, which are matched whole
//! before BPE. The pre-tokenizer (how text is cut into words before BPE) is not stored as
//! such: `tokenizer.ggml.pre` names it, and each name maps to its split regexes here.

use crate::gguf::{GgufError, GgufFile, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// DeepSeek-V3 / R1 / Kimi-style: digits in groups of up to three, CJK runs, then a GPT-like
/// word / punctuation / whitespace split.
const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// GLM-4 / GLM-5.
const GLM4: &[&str] = &[
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// GPT-2's split (llama.cpp's "default" and "gpt2").
const GPT2: &[&str] =
    &[r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"];

/// Split regexes for a `tokenizer.ggml.pre` name.
fn pre_tokenizer_regexes(pre: &str) -> Option<&'static [&'static str]> {
    match pre {
        "deepseek-v3" | "kimi-k2" => Some(DEEPSEEK_V3),
        "glm4" | "chatglm-bpe" => Some(GLM4),
        "default" | "gpt2" | "gpt-2" => Some(GPT2),
        _ => None,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{}: tokenizer {what}", .path.display())]
    Unsupported {
        path: std::path::PathBuf,
        what: String,
    },
    #[error("tokenizer: {0}")]
    Build(String),
}

/// Text <-> token ids for one model.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Prepended to every prompt when the model asks for it (tokenizer.ggml.add_bos_token).
    pub bos: Option<u32>,
    /// Generation stops here.
    pub eos: Option<u32>,
    /// Special-token strings by id (for chat templates).
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
}

fn strings(values: &[Value]) -> Vec<String> {
    values
        .iter()
        .map(|v| v.as_str().unwrap_or("").to_string())
        .collect()
}

impl Tokenizer {
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let path = file.shards()[0].path.clone();
        let unsupported = |what: String| TokenizerError::Unsupported {
            path: path.clone(),
            what,
        };
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(unsupported(format!(
                "model {model:?} is not supported: only gpt2 (byte-level BPE)"
            )));
        }
        let pre = match file.get("tokenizer.ggml.pre") {
            Some(_) => file.get_str("tokenizer.ggml.pre")?.to_string(),
            None => "default".to_string(),
        };
        let regexes = pre_tokenizer_regexes(&pre).ok_or_else(|| {
            unsupported(format!(
                "pre-tokenizer {pre:?} is not supported: known are deepseek-v3, kimi-k2, glm4, chatglm-bpe, gpt2, default"
            ))
        })?;

        let tokens = strings(file.get_array("tokenizer.ggml.tokens")?);
        let merges: Vec<(String, String)> = strings(file.get_array("tokenizer.ggml.merges")?)
            .into_iter()
            .filter_map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
        let types: Vec<i128> = match file.get("tokenizer.ggml.token_type") {
            Some(_) => file
                .get_array("tokenizer.ggml.token_type")?
                .iter()
                .map(|v| v.as_integer().unwrap_or(1))
                .collect(),
            None => vec![1; tokens.len()],
        };

        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);

        let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
        for r in regexes {
            let split = Split::new(
                SplitPattern::Regex(r.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, false, false).into());
        inner.with_pre_tokenizer(Some(Sequence::new(steps)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        // Control (3) and user-defined (4) tokens are matched whole, never split by BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(&specials);

        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match file.get(key) {
                Some(_) => Ok(Some(file.get_u32(key)?)),
                None => Ok(None),
            }
        };
        let bos_id = id("tokenizer.ggml.bos_token_id")?;
        let add_bos = match file.get("tokenizer.ggml.add_bos_token") {
            Some(_) => file.get_bool("tokenizer.ggml.add_bos_token")?,
            None => false,
        };
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let text = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).cloned());
        Ok(Tokenizer {
            bos_text: text(bos_id),
            eos_text: text(eos),
            bos: bos_id.filter(|_| add_bos),
            eos,
            inner,
        })
    }

    /// Ids of `text`, with BOS first when the model wants it. Special-token strings in the
    /// text (from a chat template) become their ids.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Turns a stream of ids into text pieces, holding back bytes of an incomplete UTF-8 character.
/// Special tokens (a BOS the model emits between documents, say) print nothing.
pub struct TextStream {
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream {
    pub fn new() -> TextStream {
        TextStream {
            ids: Vec::new(),
            printed: 0,
        }
    }

    /// The new text after appending `id` ("" while a character is incomplete).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let text = tok.inner.decode(&self.ids, true).unwrap_or_default();
        if text.ends_with('\u{FFFD}') {
            return String::new();
        }
        let new = text.get(self.printed..).unwrap_or("").to_string();
        self.printed = text.len();
        new
    }
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Renders `messages` with the model's chat template (tokenizer.chat_template, Jinja) the way
/// transformers' `apply_chat_template` does.
pub fn render_chat(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    tok: &Tokenizer,
) -> Result<String, TokenizerError> {
    let mut env = minijinja::Environment::new();
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| TokenizerError::Build(format!("chat template: {e}")))?;
    let ctx = minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => tok.bos_text.clone().unwrap_or_default(),
        eos_token => tok.eos_text.clone().unwrap_or_default(),
    };
    env.get_template("chat")
        .and_then(|t| t.render(ctx))
        .map_err(|e| TokenizerError::Build(format!("chat template: {e}")))
}
