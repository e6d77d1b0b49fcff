package agent

import "time"

// standingError is an error and since when it stands. Set again with the
// same message it keeps its first time, so a log line, an Event or a
// status that says "since" says it once, however often the cause repeats.
type standingError struct {
	err   error
	since time.Time
}

// set records err as of now and reports whether it is news: there was no
// error, or one with another message.
func (s *standingError) set(err error, now time.Time) bool {
	news := s.err == nil || s.err.Error() != err.Error()
	if news {
		s.since = now
	}
	s.err = err
	return news
}

// clear forgets the error and reports whether there was one.
func (s *standingError) clear() bool {
	was := s.err != nil
	s.err, s.since = nil, time.Time{}
	return was
}

// get is the error, nil when none stands.
func (s standingError) get() error { return s.err }

// stands reports whether an error stands.
func (s standingError) stands() bool { return s.err != nil }

// stamp is a time for messages, with its date: a checkpoint may be days old.
func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }
