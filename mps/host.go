package mps

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Host is what `gpu-agent mps-host` runs: a Supervisor whose desired daemons
// come from the agent's desired.json in Root, and whose state goes to
// health.json there, for the agent's Remote.
//
// It exists because a daemon is a child of whichever container starts it:
// when that container stops, its PID namespace (or the runtime's kill of the
// whole cgroup) ends every daemon, and every MPS client with it. The agent is
// upgraded often; mps-host is a small process in a DaemonSet of its own that
// is rarely upgraded, so the daemons live in its container instead.
//
// The Supervisor's rules hold as they are: until the first valid
// desired.json exists no daemon is touched (an earlier mps-host's are left
// alone, and adopted once they are desired); an unreadable or invalid
// desired.json is logged and the last good one kept; ending Run leaves the
// daemons running.
type Host struct {
	opts Options
	log  *slog.Logger
	sup  *Supervisor

	desiredPath, healthPath string

	// Owned by Run's goroutine.
	// gen is the generation taken in (0: none yet) and current its daemons.
	gen     int64
	current map[string]Daemon
	// carried is, by device, the newest generation whose limits its daemon
	// is known to carry.
	carried map[string]int64
	// rejected says why desired.json on disk is not what runs ("": it is).
	rejected string
	// waiting: "no desired.json yet" was logged.
	waiting bool
	// writeErr is the last health.json write error logged.
	writeErr string
}

// NewHost returns a Host over opts.Root. opts.Interval is both how often the
// daemons are checked and how often health.json is rewritten (its
// heartbeat, which the agent's Remote judges mps-host's liveness by).
func NewHost(opts Options) *Host {
	sup := NewSupervisor(opts)
	return &Host{
		opts:        sup.opts, // with the defaults filled in
		log:         sup.log.With("role", "mps-host"),
		sup:         sup,
		desiredPath: filepath.Join(opts.Root, DesiredFileName),
		healthPath:  filepath.Join(opts.Root, HealthFileName),
		current:     map[string]Daemon{},
		carried:     map[string]int64{},
	}
}

// Run follows desired.json (through change events on Root and a read every
// Interval, should an event be lost) and keeps health.json current until ctx
// ends. It then writes health.json a last time saying it stopped, and leaves
// the daemons running; in a pod they end with its container anyway.
func (h *Host) Run(ctx context.Context) error {
	if err := os.MkdirAll(h.opts.Root, 0o755); err != nil {
		return fmt.Errorf("mps-host: %w", err)
	}
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("mps-host: watch %s: %w", h.opts.Root, err)
	}
	defer fw.Close()
	if err := fw.Add(h.opts.Root); err != nil {
		return fmt.Errorf("mps-host: watch %s: %w", h.opts.Root, err)
	}

	// Read first, so that the supervisor's first pass already has the
	// daemons and adopts rather than waits.
	h.load()
	// The supervisor stops when Run says so, after the loop below saw ctx
	// end: ending on its own is then an error, not a race with ctx.
	supCtx, stopSup := context.WithCancel(context.WithoutCancel(ctx))
	defer stopSup()
	supDone := make(chan error, 1)
	go func() { supDone <- h.sup.Run(supCtx) }()
	h.writeHealth(false)

	tick := time.NewTicker(h.opts.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			stopSup()
			err := <-supDone
			h.writeHealth(true)
			h.log.Info("mps-host stopping; its daemons are left running (in a pod they end with its container)", "generation", h.gen, "daemons", len(h.current))
			return err
		case err := <-supDone:
			// Only a second Run on the same Supervisor ends by itself.
			if err == nil {
				err = errors.New("ended unexpectedly")
			}
			return fmt.Errorf("mps-host: supervisor: %w", err)
		case ev, ok := <-fw.Events:
			if !ok {
				return fmt.Errorf("mps-host: watch %s: event channel closed", h.opts.Root)
			}
			if filepath.Base(ev.Name) == DesiredFileName {
				h.load()
				h.writeHealth(false)
			}
		case err, ok := <-fw.Errors:
			if !ok {
				return fmt.Errorf("mps-host: watch %s: error channel closed", h.opts.Root)
			}
			// Typically a queue overflow: events were lost, so read anyway.
			h.log.Warn("watch on the mps root failed; reading desired.json anyway", "root", h.opts.Root, "err", err)
			h.load()
			h.writeHealth(false)
		case <-h.sup.Changes():
			h.writeHealth(false)
		case <-tick.C:
			h.load()
			h.writeHealth(false)
		}
	}
}

// load reads desired.json and hands a new, valid one to the supervisor.
func (h *Host) load() {
	f, err := ReadDesiredFile(h.desiredPath)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) && h.gen == 0 {
			if !h.waiting {
				h.log.Info("no desired.json yet: touching no mps daemon until the agent writes one", "path", h.desiredPath)
				h.waiting = true
			}
			return
		}
		why := err.Error()
		if errors.Is(err, fs.ErrNotExist) {
			why = fmt.Sprintf("%s is gone", h.desiredPath)
		}
		if why != h.rejected {
			h.log.Error("desired mps daemons not taken in; keeping the last good ones", "keeping", h.gen, "err", why)
		}
		h.rejected = why
		return
	}
	if h.rejected != "" {
		h.log.Info("desired.json is valid again", "path", h.desiredPath, "generation", f.Generation)
		h.rejected = ""
	}
	next, _ := validateDaemons(f.Daemons) // ReadDesiredFile validated them
	if f.Generation == h.gen && maps.Equal(next, h.current) {
		return
	}
	if err := h.sup.Set(f.Daemons); err != nil {
		h.rejected = fmt.Sprintf("%s: generation %d: %v", h.desiredPath, f.Generation, err)
		h.log.Error("desired mps daemons not taken in; keeping the last good ones", "keeping", h.gen, "err", h.rejected)
		return
	}
	if f.Generation < h.gen {
		// The agent's word wins; a lower number means its file was lost
		// (a wiped root) and started over.
		h.log.Warn("desired.json generation went backwards; following it", "from", h.gen, "to", f.Generation)
	}
	h.log.Info("desired mps daemons taken in", "generation", f.Generation, "previous", h.gen, "daemons", len(next))
	h.gen, h.current = f.Generation, next
}

// writeHealth writes health.json from the supervisor's view; stopped marks
// the last write of Run.
func (h *Host) writeHealth(stopped bool) {
	desired, health := h.sup.report()
	hf := HealthFile{
		Version:    FileVersion,
		Written:    h.opts.Now(),
		Interval:   Duration(h.opts.Interval),
		PID:        os.Getpid(),
		Generation: h.gen,
		Rejected:   h.rejected,
		Stopped:    stopped,
		Devices:    make(map[string]DeviceHealth, len(desired)),
	}
	for dev := range h.carried {
		if _, ok := desired[dev]; !ok {
			delete(h.carried, dev)
		}
	}
	for dev, d := range desired {
		st, ok := health[dev]
		if !ok {
			st.reason = "mps daemon starting"
		}
		// The daemon carries d's limits, which are this generation's
		// whether they were applied now or under an earlier generation
		// that asked for the same.
		if st.carries.Device != "" && st.carries == d && d == h.current[dev] {
			h.carried[dev] = h.gen
		}
		hf.Devices[dev] = DeviceHealth{Healthy: st.healthy, Reason: st.reason, PID: st.pid, Generation: h.carried[dev]}
	}
	if err := writeJSONAtomic(h.healthPath, hf); err != nil {
		if err.Error() != h.writeErr {
			h.log.Error("health.json not written; the agent will count mps-host as gone", "err", err)
			h.writeErr = err.Error()
		}
		return
	}
	h.writeErr = ""
}
