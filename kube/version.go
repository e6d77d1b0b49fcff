package kube

import (
	"context"
	"log/slog"
	"time"

	"k8s.io/client-go/discovery"
)

// VersionWatcher reads the API server's version (GET /version) at start,
// again every Every, and hands each answer to onVersion: the scheduler is
// taken to run the same version, and some device models cost it more on
// some versions. A failed read is retried after Retry, and never stops the
// watcher.
type VersionWatcher struct {
	client    discovery.ServerVersionInterface
	onVersion func(string)
	log       *slog.Logger
	// Every and Retry default to 10 minutes and 10 seconds.
	Every, Retry time.Duration
	// After is time.After; tests replace it.
	After func(time.Duration) <-chan time.Time
}

// NewVersionWatcher returns a watcher of client's server version.
func NewVersionWatcher(client discovery.ServerVersionInterface, onVersion func(string), log *slog.Logger) *VersionWatcher {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &VersionWatcher{client: client, onVersion: onVersion, log: log, Every: 10 * time.Minute, Retry: 10 * time.Second, After: time.After}
}

// Run reads the version until ctx ends; it returns nil then.
func (w *VersionWatcher) Run(ctx context.Context) error {
	last := ""
	for {
		wait := w.Every
		v, err := w.client.ServerVersion()
		switch {
		case err != nil:
			wait = w.Retry
			w.log.Debug("API server version not read; trying again", "error", err, "in", wait)
		case v.GitVersion != last:
			last = v.GitVersion
			w.log.Info("API server version", "version", last)
			w.onVersion(last)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-w.After(wait):
		}
	}
}
