//! Chat messages through the tokenizer's chat template
//! (`tokenizer_config.json`'s `chat_template`), rendered as transformers'
//! `apply_chat_template` renders it (Jinja with `trim_blocks` and
//! `lstrip_blocks`, `bos_token`, `eos_token`, `raise_exception`, Python's
//! string methods), and the byte ranges of the assistant's turns in the
//! rendered text: what a supervised conversation's loss is on.
//!
//! An assistant turn is what rendering the conversation up to it adds to
//! rendering the turns before it with the generation prompt (the template's
//! `<|im_start|>assistant\n` or its like): its content and the end of the
//! turn the template writes after it, so that the model learns to end its
//! turns. A template that does not render turn by turn (a later turn
//! changes an earlier one's text) is refused.

use std::ops::Range;

use minijinja::{Environment, Error, ErrorKind, Value};

/// A chat template, ready to render.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    bos: Option<String>,
    eos: Option<String>,
}

impl ChatTemplate {
    /// The template `source` (a `chat_template` string) with the
    /// tokenizer's begin and end of text; an error says what does not
    /// parse.
    pub(super) fn new(
        source: &str,
        bos: Option<String>,
        eos: Option<String>,
    ) -> std::result::Result<ChatTemplate, String> {
        let mut env = Environment::new();
        // As transformers' sandboxed environment.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters"),
        );
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|err| format!("its chat_template does not parse: {err}"))?;
        Ok(ChatTemplate { env, bos, eos })
    }

    fn render_turns(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let template = self
            .env
            .get_template("chat")
            .expect("added at construction");
        template
            .render(minijinja::context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos.as_deref().unwrap_or(""),
                eos_token => self.eos.as_deref().unwrap_or(""),
            })
            .map_err(|err| format!("the chat template fails on it: {err}"))
    }

    /// The conversation `messages` (objects with string `role` and
    /// `content`) as the template writes it, and the byte ranges of its
    /// assistant turns in that text.
    pub(super) fn render(
        &self,
        messages: &serde_json::Value,
    ) -> std::result::Result<(String, Vec<Range<usize>>), String> {
        let Some(turns) = messages.as_array() else {
            return Err("its messages are not a list".into());
        };
        for (i, turn) in turns.iter().enumerate() {
            for key in ["role", "content"] {
                if !turn.get(key).is_some_and(serde_json::Value::is_string) {
                    return Err(format!("its message {i} has no string {key:?}"));
                }
            }
        }
        let text = self.render_turns(turns, false)?;
        let mut spans = Vec::new();
        for (i, turn) in turns.iter().enumerate() {
            if turn["role"] != "assistant" {
                continue;
            }
            let before = self.render_turns(&turns[..i], true)?;
            let through = self.render_turns(&turns[..=i], false)?;
            if !through.starts_with(&before) || !text.starts_with(&through) {
                return Err(format!(
                    "the chat template does not render it turn by turn (the text up to assistant message {i} is not where the whole conversation has it), so its assistant turns cannot be told apart"
                ));
            }
            spans.push(before.len()..through.len());
        }
        if spans.is_empty() {
            return Err("it has no assistant message to learn from".into());
        }
        Ok((text, spans))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn assistant_turns_are_what_each_adds_to_its_generation_prompt() {
        let chat = ChatTemplate::new(CHATML, None, None).unwrap();
        let messages = serde_json::json!([
            {"role": "user", "content": " hi "},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "once more"},
        ]);
        let (text, spans) = chat.render(&messages).unwrap();
        let turns: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(turns, ["hello<|im_end|>\n", "once more<|im_end|>\n"]);
        assert!(
            text.starts_with("<|im_start|>user\nhi<|im_end|>\n"),
            "{text:?}"
        );
        let err = chat
            .render(&serde_json::json!([{"role": "user"}]))
            .unwrap_err();
        assert!(err.contains("no string \"content\""), "{err}");
        let err = chat
            .render(&serde_json::json!([{"role": "user", "content": "x"}]))
            .unwrap_err();
        assert!(err.contains("no assistant message"), "{err}");
        let strict = ChatTemplate::new(
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}",
            None,
            None,
        )
        .unwrap();
        let err = strict.render(&messages).unwrap_err();
        assert!(err.contains("a system message first"), "{err}");
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
