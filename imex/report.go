package imex

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
)

// The names of the contract with the controller (computedomain/controller,
// contract.go) the node side writes; a test holds them equal.
const (
	// NodeFieldManagerPrefix + the node's name is the field manager of
	// the node's apply of its own status.nodes entry.
	NodeFieldManagerPrefix = DriverName + "/"
	// ConditionDaemonReady and ConditionDaemonFailed are the binding
	// conditions published on the channel devices: the controller sets the
	// first True in a claim's status once the node's entry is Ready, the
	// second when the node cannot join the domain.
	ConditionDaemonReady  = DriverName + "/DaemonReady"
	ConditionDaemonFailed = DriverName + "/DaemonFailed"
)

// StatusApplier writes what the node side reports of a domain: the status
// of its own entry in status.nodes.
type StatusApplier interface {
	ApplyNodeStatus(ctx context.Context, cd *cdv1.ComputeDomain, node string, status cdv1.Status) error
}

// Reporter applies a node's entry status through the API (server-side
// apply of the status subresource).
type Reporter struct {
	Client dynamic.Interface
}

// NodeStatusPatch is the apply configuration of node's entry status in
// cd: the entry's key and status, nothing else, at the resourceVersion cd
// was read at. The CRD makes status.nodes a list-map keyed by name, so the
// apply merges into that one entry; the resourceVersion makes it a
// conflict, not a new entry, when the controller removed the entry
// meanwhile (a node side creates no entry).
func NodeStatusPatch(cd *cdv1.ComputeDomain, node string, status cdv1.Status) ([]byte, error) {
	if cd.ResourceVersion == "" {
		return nil, fmt.Errorf("ComputeDomain %s/%s: no resourceVersion to apply at", cd.Namespace, cd.Name)
	}
	type entry struct {
		Name   string      `json:"name"`
		Status cdv1.Status `json:"status"`
	}
	patch := map[string]any{
		"apiVersion": cdv1.APIVersion,
		"kind":       cdv1.KindComputeDomain,
		"metadata":   map[string]any{"name": cd.Name, "namespace": cd.Namespace, "resourceVersion": cd.ResourceVersion},
		"status":     map[string]any{"nodes": []entry{{Name: node, Status: status}}},
	}
	return json.Marshal(patch)
}

// ApplyNodeStatus implements [StatusApplier]: field manager
// NodeFieldManagerPrefix+node, forced, since the controller's status
// updates own every field they wrote, this one included.
func (r Reporter) ApplyNodeStatus(ctx context.Context, cd *cdv1.ComputeDomain, node string, status cdv1.Status) error {
	patch, err := NodeStatusPatch(cd, node, status)
	if err != nil {
		return err
	}
	_, err = r.Client.Resource(ComputeDomains).Namespace(cd.Namespace).Patch(ctx, cd.Name, types.ApplyPatchType, patch,
		metav1.PatchOptions{FieldManager: NodeFieldManagerPrefix + node, Force: ptr.To(true)}, "status")
	if err != nil {
		return fmt.Errorf("ComputeDomain %s/%s: apply status.nodes[%s].status=%s: %w", cd.Namespace, cd.Name, node, status, err)
	}
	return nil
}

// report is a status applied to a domain's entry, at a resourceVersion.
type report struct {
	status          cdv1.Status
	resourceVersion string
}

// dueReport is a write of the node's entry status to make.
type dueReport struct {
	domain string
	cd     *cdv1.ComputeDomain
	status cdv1.Status
}

// reportsLocked are the entries whose status differs from what the local
// daemon says: Ready once it answers READY, NotReady while it does not
// (starting, waiting for its peers, failed). Only entries the controller
// made are written; a domain not listing this node gets nothing.
func (d *Driver) reportsLocked() []dueReport {
	if d.opts.Status == nil || d.opts.Domains == nil || d.opts.Daemons == nil {
		return nil
	}
	var due []dueReport
	for _, dom := range d.daemonDomainsLocked() {
		cd, ok := d.opts.Domains.Domain(dom)
		if !ok {
			delete(d.reported, dom)
			continue
		}
		var self *cdv1.ComputeDomainNode
		for i := range cd.Status.Nodes {
			if cd.Status.Nodes[i].Name == d.opts.NodeName {
				self = &cd.Status.Nodes[i]
			}
		}
		if self == nil {
			delete(d.reported, dom)
			continue
		}
		want := cdv1.StatusNotReady
		if d.opts.Daemons.State(dom).Ready {
			want = cdv1.StatusReady
		}
		// An entry without a status reads as NotReady (the CRD's and the
		// controller's default).
		if self.Status == want || self.Status == "" && want == cdv1.StatusNotReady {
			continue
		}
		if r := d.reported[dom]; r.status == want && r.resourceVersion == cd.ResourceVersion {
			continue // applied; the watch has not shown it yet
		}
		due = append(due, dueReport{domain: dom, cd: cd, status: want})
	}
	for dom := range d.reported {
		if !slices.Contains(d.daemonDomainsLocked(), dom) {
			delete(d.reported, dom)
		}
	}
	return due
}

// applyReports writes the due reports, outside the driver's lock. A
// conflict (the controller wrote the domain since it was read) is left to
// the watch, which brings the newer object and another refresh; any other
// failure is retried shortly.
func (d *Driver) applyReports(ctx context.Context, due []dueReport) {
	failed := false
	for _, r := range due {
		err := d.opts.Status.ApplyNodeStatus(ctx, r.cd, d.opts.NodeName, r.status)
		switch {
		case err == nil:
			d.log.Info("IMEX: readiness reported", "domain", r.cd.Namespace+"/"+r.cd.Name, "status", r.status)
			d.mu.Lock()
			d.reported[r.domain] = report{status: r.status, resourceVersion: r.cd.ResourceVersion}
			d.mu.Unlock()
		case apierrors.IsConflict(err):
			d.log.Info("IMEX: readiness report conflicts with a newer domain; waiting for it", "err", err)
		default:
			d.log.Error("IMEX: readiness not reported", "err", err)
			failed = true
		}
	}
	if failed {
		time.AfterFunc(2*time.Second, func() {
			select {
			case d.retry <- struct{}{}:
			default:
			}
		})
	}
}
