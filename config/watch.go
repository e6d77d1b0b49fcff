package config

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Update is the content of the watched file after a change, or why it could
// not be read (ReadFile's bounds apply). Decoding is the consumer's job; on a
// parse or read error it keeps its last good config.
type Update struct {
	// Data is the content of a single config file (--config naming a file).
	Data []byte
	// Files, instead of Data, holds every key of a ConfigMap by key: a
	// watched ConfigMap volume directory (ReadDir), or the ConfigMap read
	// through the API. ParseConfigMap reads it. Exactly one of Data and
	// Files is set in an Update with content; neither when Err is set.
	Files map[string]string
	Err   error
}

// Parse decodes the update's content: Files with ParseConfigMap, Data with
// Parse. defaultKey (--default-config) names the config for nodes that
// nothing selects, in both cases; "" for none. For a single file it must
// name one of the file's configs, as for a ConfigMap.
func (u Update) Parse(defaultKey string) (*File, []string, error) {
	return u.ParseWith(defaultKey, ParseOptions{})
}

// ParseWith is Parse with the agent's options (--mig-strategy).
func (u Update) ParseWith(defaultKey string, o ParseOptions) (*File, []string, error) {
	if u.Files != nil {
		return ParseConfigMapWith(u.Files, defaultKey, o)
	}
	if defaultKey == "" {
		return ParseWith(u.Data, o)
	}
	// The whole-file checks run once the default key is known: a file
	// without a "default" config is then not worth a warning.
	f, warnings, err := parse(u.Data, newDecoder(), checkLocal|checkRefs, o)
	if err != nil {
		return nil, warnings, err
	}
	if _, ok := f.Configs[defaultKey]; !ok {
		return nil, warnings, ErrorList{{Msg: fmt.Sprintf("default key %q names no config (configs: %s)", defaultKey, listNames(f.Configs))}}
	}
	f.DefaultKey = defaultKey
	v := newValidator(f, checkWhole)
	v.file()
	warnings = append(warnings, v.warnings...)
	if err := v.errs.err(); err != nil {
		return nil, warnings, err
	}
	return f, warnings, nil
}

// Watcher follows a config file in a mounted ConfigMap. The kubelet updates
// such a mount by writing a new timestamped directory, renaming a fresh
// ..data_tmp symlink over ..data and deleting the old directory; the key
// itself is a symlink key -> ..data/key that never changes. A watch on the
// file would see nothing (or follow a deleted inode), so the directory
// holding it is watched, and every event leads to re-reading the file through
// its symlinks and comparing contents.
type Watcher struct {
	path string
	dir  string
	// isDir: path is a ConfigMap volume directory, not one key file.
	isDir  bool
	logger *slog.Logger

	// Debounce is how long the directory must be quiet before the file is
	// read; one kubelet update is several events in a few milliseconds.
	Debounce time.Duration
	// ErrorGrace is how long the file may be unreadable before an Update
	// with Err is sent: between the steps of an update it briefly is.
	ErrorGrace time.Duration
	// Resync re-reads the file this often regardless of events (0: never),
	// covering events lost to an inotify queue overflow.
	Resync time.Duration
	// Rewatch is how often a vanished directory is looked for.
	Rewatch time.Duration
}

// NewWatcher watches the file at path. The directory need not exist yet.
// Fields may be changed before Run.
func NewWatcher(path string, logger *slog.Logger) (*Watcher, error) {
	if path == "" {
		return nil, errors.New("config watcher: empty path")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("config watcher %s: %w", path, err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	dir := filepath.Dir(abs)
	isDir := false
	if st, err := os.Stat(abs); err == nil && st.IsDir() {
		// The ConfigMap volume itself: every key is read (multi-key
		// ConfigMaps), and the directory is what changes.
		dir, isDir = abs, true
	}
	return &Watcher{
		path:       abs,
		dir:        dir,
		isDir:      isDir,
		logger:     logger.With("config", abs),
		Debounce:   100 * time.Millisecond,
		ErrorGrace: 2 * time.Second,
		Resync:     time.Minute,
		Rewatch:    500 * time.Millisecond,
	}, nil
}

// watchState is what has been sent so far.
type watchState struct {
	sum      [sha256.Size]byte
	sent     bool      // anything was sent
	errSent  bool      // the last Update sent was an error
	errSince time.Time // start of the current run of read failures
}

// Run sends the file's content to out, first the initial content (or read
// error), then each time the content changes. It returns nil when ctx ends,
// and an error only if watching itself fails. It does not close out.
func (w *Watcher) Run(ctx context.Context, out chan<- Update) error {
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("config watcher %s: %w", w.path, err)
	}
	defer fw.Close()

	// Timers start stopped; Go 1.23+ timers need no draining before Reset.
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	rewatch := time.NewTimer(time.Hour)
	rewatch.Stop()
	var resync <-chan time.Time
	if w.Resync > 0 {
		t := time.NewTicker(w.Resync)
		defer t.Stop()
		resync = t.C
	}

	watching := w.watch(fw)
	if !watching {
		rewatch.Reset(w.Rewatch)
	}
	var st watchState
	// The initial read reports an error at once: the consumer has no config
	// yet and must know why.
	if !w.check(ctx, out, &st, true, debounce) {
		return nil
	}

	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-fw.Events:
			if !ok {
				return fmt.Errorf("config watcher %s: event channel closed", w.path)
			}
			w.logger.Debug("config dir event", "event", ev.String())
			if ev.Name == w.dir && ev.Has(fsnotify.Remove|fsnotify.Rename) {
				// The directory itself went away (or moved: the watch would
				// follow the moved inode). Look for a new one.
				_ = fw.Remove(w.dir)
				watching = false
				rewatch.Reset(w.Rewatch)
			}
			debounce.Reset(w.Debounce)
		case err, ok := <-fw.Errors:
			if !ok {
				return fmt.Errorf("config watcher %s: error channel closed", w.path)
			}
			// Typically a queue overflow: events were lost, so read anyway.
			w.logger.Warn("config watch error", "err", err)
			debounce.Reset(w.Debounce)
		case <-rewatch.C:
			if watching = w.watch(fw); watching {
				debounce.Reset(0)
			} else {
				rewatch.Reset(w.Rewatch)
			}
		case <-resync:
			if !watching {
				continue // rewatch reads when the directory is back
			}
			if !w.check(ctx, out, &st, false, debounce) {
				return nil
			}
		case <-debounce.C:
			if !w.check(ctx, out, &st, false, debounce) {
				return nil
			}
		}
	}
}

// watch adds the directory's watch; false if the directory is missing.
func (w *Watcher) watch(fw *fsnotify.Watcher) bool {
	if err := fw.Add(w.dir); err != nil {
		w.logger.Debug("config dir not watchable yet", "dir", w.dir, "err", err)
		return false
	}
	return true
}

// check reads the file and sends an Update when its content differs from
// what was last sent, or when it has been unreadable for ErrorGrace. It
// returns false when ctx ended while sending.
func (w *Watcher) check(ctx context.Context, out chan<- Update, st *watchState, initial bool, retry *time.Timer) bool {
	var data []byte
	var files map[string]string
	var err error
	if w.isDir {
		if files, err = ReadDir(w.path); err == nil {
			// Each key and value length-prefixed, so that no two maps
			// serialise alike (a value may hold any byte).
			for _, k := range slices.Sorted(maps.Keys(files)) {
				data = binary.AppendUvarint(data, uint64(len(k)))
				data = append(data, k...)
				data = binary.AppendUvarint(data, uint64(len(files[k])))
				data = append(data, files[k]...)
			}
		}
	} else if data, err = ReadFile(w.path); err == nil {
		// A ConfigMap manifest given as the file (deploy/examples, what
		// `config validate` reads) is read as the ConfigMap it describes:
		// every key a config, as when it is mounted.
		var manifest bool
		if files, manifest, err = ConfigMapManifest(data); err != nil {
			err = fmt.Errorf("%s: %w", w.path, err)
		} else if !manifest {
			files = nil
		}
	}
	if err != nil {
		if st.errSent {
			return true
		}
		now := time.Now()
		if st.errSince.IsZero() {
			st.errSince = now
		}
		if !initial && now.Sub(st.errSince) < w.ErrorGrace {
			// Probably mid-update: look again before reporting.
			w.logger.Debug("config file unreadable; looking again before reporting", "err", err)
			retry.Reset(min(w.Debounce, w.ErrorGrace-now.Sub(st.errSince)))
			return true
		}
		w.logger.Warn("config file unreadable", "err", err)
		st.errSent, st.sent = true, true
		return send(ctx, out, Update{Err: err}) // ReadFile's errors name the path
	}
	st.errSince = time.Time{}
	sum := sha256.Sum256(data)
	if st.sent && !st.errSent && bytes.Equal(sum[:], st.sum[:]) {
		return true
	}
	st.sum, st.sent, st.errSent = sum, true, false
	w.logger.Info("config content changed", "bytes", len(data), "initial", initial)
	if files != nil {
		return send(ctx, out, Update{Files: files})
	}
	return send(ctx, out, Update{Data: data})
}

func send(ctx context.Context, out chan<- Update, u Update) bool {
	select {
	case out <- u:
		return true
	case <-ctx.Done():
		return false
	}
}
