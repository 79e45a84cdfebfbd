//! Stop strings matched on detokenized text, across token boundaries.
//!
//! A stop string may arrive split over several tokens, so the last `longest_stop - 1` bytes of
//! text are held back until it is clear they do not begin a stop string. Text is released only
//! at char boundaries; what matched (and anything after it) is never sent.

pub struct StopMatcher {
    stops: Vec<String>,
    hold: usize,
    pending: String,
    /// The stop string that matched, once one has.
    matched: Option<usize>,
}

/// What to do after new text arrived.
#[derive(Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// Send this text (possibly empty) and go on.
    Continue(String),
    /// A stop string matched: send this text, then finish.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let hold = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        StopMatcher { stops, hold, pending: String::new(), matched: None }
    }

    pub fn push(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck::Continue(text.to_string());
        }
        self.pending.push_str(text);
        // Earliest match wins, whichever stop string it is.
        if let Some((at, i)) =
            self.stops.iter().enumerate().filter_map(|(i, s)| Some((self.pending.find(s.as_str())?, i))).min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            self.matched = Some(i);
            return StopCheck::Stopped(out);
        }
        let mut cut = self.pending.len().saturating_sub(self.hold);
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopCheck::Continue(out)
    }

    /// The held-back text, at the end of a stream that did not stop on a string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopCheck::Continue(t) => out += &t,
                StopCheck::Stopped(t) => return (out + &t, true),
            }
        }
        (out + &m.finish(), false)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_caught_and_trimmed() {
        assert_eq!(run(&["END"], &["hello E", "N", "D and more"]), ("hello ".into(), true));
    }

    #[test]
    fn text_without_a_stop_is_delivered_whole() {
        assert_eq!(run(&["xyz"], &["ab", "cx", "yd", "e"]), ("abcxyde".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
    }

    #[test]
    fn the_stop_string_that_ended_the_text_is_named() {
        let mut m = StopMatcher::new(vec!["cd".into(), "".into(), "b".into()]);
        assert_eq!(m.matched(), None);
        assert_eq!(m.push("a"), StopCheck::Continue("".into()), "held: it could begin a stop");
        assert_eq!(m.matched(), None, "nothing matched yet");
        assert_eq!(m.push("bcd"), StopCheck::Stopped("a".into()));
        assert_eq!(m.matched(), Some("b"), "the earliest match, not the first listed");
    }

    #[test]
    fn holding_back_never_splits_a_multibyte_char() {
        assert_eq!(run(&["日本語!"], &["こん", "にちは", "日本"]), ("こんにちは日本".into(), false));
    }

    #[test]
    fn no_stops_means_no_holding_back() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("abc"), StopCheck::Continue("abc".into()));
    }
}
