package mps

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
)

// RemoteOptions configure a Remote. Zero values take the defaults noted.
type RemoteOptions struct {
	// Root is the MPS root mps-host also mounts; desired.json and
	// health.json live there.
	Root   string
	Logger *slog.Logger
	// Poll is how often health.json is read besides its change events, and
	// so how soon a silent mps-host is noticed once it is overdue (default 2s).
	Poll time.Duration
	// StaleAfter is how many of mps-host's intervals health.json may go
	// unwritten before mps-host counts as not running (default 3: one late
	// write is a busy node, three is a dead or hung mps-host).
	StaleAfter int
	// Now is the clock health.json's age is measured on (default time.Now).
	Now func() time.Time
}

// Remote is the agent's side of mps-host: the same Set, Healthy and Changes
// as Supervisor, for an agent that runs no daemon itself. Set writes
// desired.json; Healthy answers from health.json, which Run keeps reading.
//
// A health.json that is missing, unreadable, marked stopped, or older than
// StaleAfter of mps-host's intervals means mps-host is not running: every
// device is then unhealthy, so that no replica is offered healthy while no
// daemon is looked after.
//
// Before the first Set, Healthy answers for the daemons desired.json already
// lists (those the previous agent asked for), so an agent restart does not
// turn replicas of running daemons unhealthy for a moment.
type Remote struct {
	opts        RemoteOptions
	log         *slog.Logger
	changes     chan struct{}
	desiredPath string
	healthPath  string

	mu sync.Mutex
	// desired is the file last written or, before that, read at start (nil:
	// none); byDevice its daemons.
	desired  *DesiredFile
	byDevice map[string]Daemon
	// health is the last health.json read (nil with healthErr set).
	health    *HealthFile
	healthErr error
	// view is what Healthy's answers are derived from; a change of it is
	// signalled on changes.
	view string
	// down says why mps-host counted as not running at the last read ("":
	// it ran).
	down string
}

// NewRemote reads desired.json and health.json under opts.Root as they are
// now; call Run to follow health.json.
func NewRemote(opts RemoteOptions) *Remote {
	if opts.Poll <= 0 {
		opts.Poll = 2 * time.Second
	}
	if opts.StaleAfter <= 0 {
		opts.StaleAfter = 3
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := &Remote{
		opts:        opts,
		log:         log.With("component", "mps", "via", "mps-host"),
		changes:     make(chan struct{}, 1),
		desiredPath: filepath.Join(opts.Root, DesiredFileName),
		healthPath:  filepath.Join(opts.Root, HealthFileName),
		byDevice:    map[string]Daemon{},
	}
	switch f, err := ReadDesiredFile(r.desiredPath); {
	case err == nil:
		r.desired = f
		r.byDevice, _ = validateDaemons(f.Daemons)
	case !errors.Is(err, fs.ErrNotExist):
		r.log.Warn("previous desired.json unreadable; the first Set replaces it", "err", err)
	}
	r.refresh()
	return r
}

// Set asks mps-host for exactly these daemons: it writes desired.json, with
// the next generation, when they differ from those last asked for (or the
// file is gone). An invalid list is refused as a whole, as Supervisor.Set
// refuses it, and nothing is written.
func (r *Remote) Set(daemons []Daemon) error {
	next, err := validateDaemons(daemons)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.desired != nil && maps.Equal(next, r.byDevice) {
		if _, err := os.Stat(r.desiredPath); err == nil {
			return nil
		}
	}
	var gen int64
	if r.desired != nil {
		gen = r.desired.Generation
	}
	if r.health != nil {
		// A desired.json lost with the agent's memory of it must not
		// reuse a generation mps-host has already seen.
		gen = max(gen, r.health.Generation)
	}
	f := &DesiredFile{Version: FileVersion, Generation: gen + 1, Daemons: slices.Clone(daemons)}
	slices.SortFunc(f.Daemons, func(a, b Daemon) int { return cmp.Compare(a.Device, b.Device) })
	if err := os.MkdirAll(r.opts.Root, 0o755); err != nil {
		return fmt.Errorf("mps: %w", err)
	}
	if err := writeJSONAtomic(r.desiredPath, f); err != nil {
		return fmt.Errorf("mps: ask mps-host for daemons: %w", err)
	}
	r.desired, r.byDevice = f, next
	r.log.Info("asked mps-host for mps daemons", "generation", f.Generation, "daemons", len(f.Daemons), "path", r.desiredPath)
	return nil
}

// Healthy reports whether device's daemon answers mps-host, and why not
// when it does not, or when mps-host itself is not running.
func (r *Remote) Healthy(device string) (bool, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.byDevice[device]; !ok {
		return false, "no mps daemon for this device"
	}
	// As of the last read, not now: an answer changes only together with a
	// signal on Changes, or the agent could plan on a staleness it is
	// never told has passed.
	if r.down != "" {
		return false, "mps-host not running: " + r.down
	}
	h := r.health
	if h.Rejected != "" && h.Generation < r.desired.Generation {
		// Its daemons may run with other limits than those clients are
		// told, and typically this is an mps-host too old for this agent's
		// file: show it rather than offer replicas on a guess.
		return false, fmt.Sprintf("mps-host did not take in generation %d (it keeps %d): %s", r.desired.Generation, h.Generation, h.Rejected)
	}
	if dh, ok := h.Devices[device]; ok {
		if !dh.Healthy && dh.Reason == "" {
			return false, "mps-host reports the daemon unhealthy without a reason"
		}
		return dh.Healthy, dh.Reason
	}
	if h.Generation < r.desired.Generation {
		return false, fmt.Sprintf("mps daemon starting: mps-host has not taken in generation %d yet (runs %d)", r.desired.Generation, h.Generation)
	}
	return false, fmt.Sprintf("mps-host runs no daemon for this device in generation %d", h.Generation)
}

// hostDown says why mps-host counts as not running ("": it runs). r.mu held.
func (r *Remote) hostDown() string {
	if r.healthErr != nil {
		if errors.Is(r.healthErr, fs.ErrNotExist) {
			return fmt.Sprintf("no %s (is `gpu-agent mps-host` running on this node?)", r.healthPath)
		}
		return r.healthErr.Error()
	}
	h := r.health
	if h.Stopped {
		return fmt.Sprintf("it stopped (pid %d) at %s, per %s", h.PID, h.Written.Format(time.RFC3339), r.healthPath)
	}
	interval := time.Duration(h.Interval)
	bound := time.Duration(r.opts.StaleAfter) * interval
	if age := r.opts.Now().Sub(h.Written); age > bound {
		return fmt.Sprintf("%s last written %s ago (pid %d), over the %s bound (%d × its %s interval)",
			r.healthPath, age.Round(time.Millisecond), h.PID, bound, r.opts.StaleAfter, interval)
	}
	return ""
}

// Changes receives a value (coalesced) whenever what Healthy answers may
// have changed: health.json's content, or mps-host turning up or going away.
func (r *Remote) Changes() <-chan struct{} { return r.changes }

// Run follows health.json (change events on Root, and a read every Poll,
// which also notices a health.json that stops being rewritten) until ctx
// ends; it returns nil. A watch that cannot be set up leaves the polling.
func (r *Remote) Run(ctx context.Context) error {
	var events <-chan fsnotify.Event
	var errs <-chan error
	if err := os.MkdirAll(r.opts.Root, 0o755); err != nil {
		r.log.Warn("mps root not usable; reading health.json by polling only", "root", r.opts.Root, "err", err)
	} else if fw, err := fsnotify.NewWatcher(); err != nil {
		r.log.Warn("cannot watch the mps root; reading health.json by polling only", "root", r.opts.Root, "err", err)
	} else {
		defer fw.Close()
		if err := fw.Add(r.opts.Root); err != nil {
			r.log.Warn("cannot watch the mps root; reading health.json by polling only", "root", r.opts.Root, "err", err)
		} else {
			events, errs = fw.Events, fw.Errors
		}
	}
	tick := time.NewTicker(r.opts.Poll)
	defer tick.Stop()
	r.refresh()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-events:
			if !ok {
				events = nil // polling carries on
				continue
			}
			if filepath.Base(ev.Name) == HealthFileName {
				r.refresh()
			}
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			r.log.Warn("watch on the mps root failed; reading health.json anyway", "err", err)
			r.refresh()
		case <-tick.C:
			r.refresh()
		}
	}
}

// refresh reads health.json and signals Changes when what Healthy answers
// from changed.
func (r *Remote) refresh() {
	h, err := ReadHealthFile(r.healthPath)
	r.mu.Lock()
	r.health, r.healthErr = h, err
	down := r.hostDown()
	view := r.viewLocked(down != "")
	changed := view != r.view
	r.view = view
	if down != "" && r.down == "" {
		r.log.Warn("mps-host not running: MPS replicas are offered unhealthy until it is back", "why", down)
	} else if down == "" && r.down != "" {
		r.log.Info("mps-host running", "pid", h.PID, "generation", h.Generation)
	}
	r.down = down
	r.mu.Unlock()
	if changed {
		select {
		case r.changes <- struct{}{}:
		default:
		}
	}
}

// viewLocked is health.json's content less its heartbeat timestamp, with
// whether mps-host counts as running: a rewrite that changes nothing else
// is no change. r.mu held.
func (r *Remote) viewLocked(down bool) string {
	if r.healthErr != nil {
		return fmt.Sprintf("down=%v err=%v", down, r.healthErr)
	}
	h := *r.health
	h.Written = time.Time{}
	b, _ := json.Marshal(h)
	return fmt.Sprintf("down=%v %s", down, b)
}
