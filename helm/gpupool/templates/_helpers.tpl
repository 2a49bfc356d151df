{{/* Labels of every object of this chart. */}}
{{- define "gpupool.labels" -}}
app.kubernetes.io/name: gpupool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* GPU-equivalents as a Kubernetes quantity in thousandths: 1.5 -> "1500m". */}}
{{- define "gpupool.milli" -}}
{{- printf "%dm" (int (round (mulf (float64 .) 1000) 0)) -}}
{{- end }}

{{/*
GPU-equivalents as a plain count of thousandths: 1.5 -> "1500". Kueue's quota resource is
counted in thousandths because Kueue counts every resource but cpu in whole units, rounding a
fraction up (kueue pkg/resources/requests.go ResourceValue and amount.go AmountFromQuantity:
Quantity.Value()), so "500m" would be charged as 1.
*/}}
{{- define "gpupool.thousandths" -}}
{{- printf "%d" (int (round (mulf (float64 .) 1000) 0)) -}}
{{- end }}

{{/* The device-plugin resource of a MIG profile: 1g.10gb+me -> nvidia.com/mig-1g.10gb.me. */}}
{{- define "gpupool.migResource" -}}
{{- printf "nvidia.com/mig-%s" (replace "+me" ".me" .) -}}
{{- end }}

{{/* files/gpu-equivalents.yaml: model -> resource -> thousandths (generated from gpupool). */}}
{{- define "gpupool.table" -}}
{{- .Files.Get "files/gpu-equivalents.yaml" -}}
{{- end }}

{{/*
Checks across values that a JSON schema cannot express; each failure names the key to fix.
- every offer a team (or everyone) lists is defined in gpupool.offers;
- every MIG offer's profile exists on some GPU model gpupool knows;
- a share's memory is at least 1 MiB and at most what its model has (gpupool.declarations'
  parse_memory: GB and GiB are 1024 MiB, MB and MiB are MiB; the schema checks the spelling).
The kind an offer implies by its name follows gpupool.declarations.default_kind.
*/}}
{{- define "gpupool.validate" -}}
{{- $offers := .Values.gpupool.offers -}}
{{- $teams := deepCopy .Values.gpupool.teams -}}
{{- $_ := set $teams "everyone" (.Values.gpupool.everyone | default dict) -}}
{{- range $team, $spec := $teams }}
{{- range $offer := ($spec.offers | default list) }}
{{- if not (hasKey $offers $offer) }}
{{- fail (printf "gpupool.teams.%s.offers: unknown offer %q; define it under gpupool.offers (defined: %s)" $team $offer (keys $offers | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}
{{- $table := include "gpupool.table" . | fromYaml -}}
{{- range $name, $spec := $offers }}
{{- $spec = $spec | default dict }}
{{- $kind := $spec.kind | default (ternary "cpu" (ternary "mig" (ternary "share" "gpu" (hasPrefix "share-" $name)) (hasPrefix "mig-" $name)) (eq $name "cpu")) }}
{{- if and (eq $kind "share") (kindIs "string" $spec.memory) }}
{{- $size := "(?i)^\\s*([0-9]+(?:\\.[0-9]+)?)\\s*(GB|GiB|MB|MiB)\\s*$" }}
{{- $number := regexReplaceAll $size $spec.memory "${1}" | float64 }}
{{- $mib := ternary (mulf $number 1024) $number (hasPrefix "g" (regexReplaceAll $size $spec.memory "${2}" | lower)) }}
{{- if le $mib 0.5 }}
{{- fail (printf "gpupool.offers.%s.memory: must be a size like '6GB' or '512MB' (GB = 1024 MiB), got %q" $name $spec.memory) }}
{{- end }}
{{- $modelGB := regexReplaceAll "^.*-([0-9]+)GB$" (regexFind "-[0-9]+GB$" ($spec.model | default "")) "${1}" }}
{{- if and $modelGB (gt (round $mib 0) (mulf (float64 $modelGB) 1024)) }}
{{- fail (printf "gpupool.offers.%s.memory: %s is more than a %s has" $name $spec.memory $spec.model) }}
{{- end }}
{{- end }}
{{- if eq $kind "mig" }}
{{- $resource := include "gpupool.migResource" ($spec.profile | default (trimPrefix "mig-" $name)) }}
{{- $found := false }}
{{- range $model, $costs := $table }}
{{- if and (hasKey $costs $resource) (or (not $spec.model) (eq $spec.model $model)) }}{{ $found = true }}{{ end }}
{{- end }}
{{- if not $found }}
{{- fail (printf "gpupool.offers.%s: %s is not a MIG profile of %s; name the offer mig-<profile> with a profile like 3g.40gb, or set profile" $name ($spec.profile | default (trimPrefix "mig-" $name)) ($spec.model | default "any GPU model gpupool knows")) }}
{{- end }}
{{- if not $spec.model }}
{{- $shares := dict }}
{{- range $model, $costs := $table }}
{{- if hasKey $costs $resource }}{{ $_ := set $shares (printf "%s (%dm)" $model (int (get $costs $resource))) (int (get $costs $resource)) }}{{ end }}
{{- end }}
{{- if gt (len (values $shares | uniq)) 1 }}
{{- fail (printf "gpupool.offers.%s.model: %s takes a different share of the GPU on %s; set model to one of them" $name ($spec.profile | default (trimPrefix "mig-" $name)) (keys $shares | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.kueue.enabled (le (int .Values.kueue.priorities.notebook) (int .Values.kueue.priorities.job)) }}
{{- fail (printf "kueue.priorities.notebook: %d must be above kueue.priorities.job (%d): a queued job must never preempt a notebook" (int .Values.kueue.priorities.notebook) (int .Values.kueue.priorities.job)) }}
{{- end }}
{{- if and .Values.priorityClasses.enabled (le (int .Values.priorityClasses.notebook) (int .Values.priorityClasses.job)) }}
{{- fail (printf "priorityClasses.notebook: %d must be above priorityClasses.job (%d): a queued job must never evict a notebook" (int .Values.priorityClasses.notebook) (int .Values.priorityClasses.job)) }}
{{- end }}
{{- end }}

{{/*
The two idle reapers agree: the JupyterHub chart's culler (no warning) must wait longer than
gpupool's reclaimer (warns first) takes for any team whose reclaim is on, plus one culler pass.
The argument is the IdleReclaimer.policies dict; checks .Values.jupyterhub.cull of the root.
*/}}
{{- define "gpupool.validateCull" -}}
{{- $root := index . 0 }}
{{- $policies := index . 1 | default dict }}
{{- $cull := $root.Values.jupyterhub.cull | default dict }}
{{- if and $root.Values.jupyterhub.enabled $cull.enabled }}
{{- $base := merge (deepCopy (get $policies "*" | default dict)) (dict "idle_minutes" 120 "action" "stop") }}
{{- $longest := 0.0 }}
{{- $who := "" }}
{{- range $team, $policy := (merge (dict "*" $base) $policies) }}
{{- $eff := merge (deepCopy ($policy | default dict)) $base }}
{{- if and (ne $eff.action "off") (gt (float64 $eff.idle_minutes) $longest) }}
{{- $longest = float64 $eff.idle_minutes }}{{ $who = $team }}
{{- end }}
{{- end }}
{{- $needed := add (int (ceil (mulf $longest 60))) (int ($cull.every | default 600)) }}
{{- if lt (int ($cull.timeout | default 3600)) (int $needed) }}
{{- fail (printf "jupyterhub.cull.timeout: %d seconds would stop GPU notebooks without gpupool's warning; gpupool reclaims idle GPU notebooks after %v minutes (team %q), so set it to at least %d (that plus jupyterhub.cull.every) or turn the culler off" (int ($cull.timeout | default 3600)) $longest $who (int $needed)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The Secret holding the Prometheus service's token: the JupyterHub chart's own hub Secret (always
created, with every hub.services.<name>.apiToken; hub.existingSecret does not replace it), named
by the JupyterHub chart's helper, which follows jupyterhub.fullnameOverride.
*/}}
{{- define "gpupool.tokenSecretName" -}}
{{- if .Values.metrics.serviceMonitor.tokenSecret.name }}
{{- .Values.metrics.serviceMonitor.tokenSecret.name }}
{{- else if .Values.jupyterhub.enabled }}
{{- include "jupyterhub.hub.fullname" . }}
{{- else }}
{{- /* the JupyterHub chart installed on its own, with its default names */}}
{{- "hub" }}
{{- end }}
{{- end }}

{{/* The LocalQueue (and ClusterQueue) name of a team: <release>-<team>. */}}
{{- define "gpupool.queueTemplate" -}}
{{- printf "%s-{team}" .Release.Name -}}
{{- end }}

{{/*
The teams Kueue gets a ClusterQueue for: every team, plus `everyone` when it has GPU quota.
A dict team -> spec.
*/}}
{{- define "gpupool.queueTeams" -}}
{{- $teams := deepCopy .Values.gpupool.teams -}}
{{- $everyone := .Values.gpupool.everyone | default dict -}}
{{- if or $everyone.guarantee $everyone.borrow_limit }}
{{- $_ := set $teams "everyone" $everyone -}}
{{- end }}
{{- toYaml $teams -}}
{{- end }}

{{/*
Kueue resource transformations: each GPU/MIG resource of the listed models -> thousandths of a
GPU-equivalent, and with kueue.hami HAMi's memory resource (MiB) -> its fraction of a GPU and
HAMi's count resource -> nothing. Fails when two models price one resource differently (Kueue
cannot tell them apart), or HAMi's count is a resource the table prices.
*/}}
{{- define "gpupool.transformations" -}}
{{- $table := include "gpupool.table" . | fromYaml -}}
{{- $merged := dict -}}
{{- $from := dict -}}
{{- range $model := .Values.kueue.gpuModels }}
{{- range $resource, $milli := (get $table $model) }}
{{- if and (hasKey $merged $resource) (ne (int (get $merged $resource)) (int $milli)) }}
{{- fail (printf "kueue.gpuModels: %s is %dm of a GPU on %s but %dm on %s; Kueue cannot tell them apart, so list models that agree (or run one gpupool per model)" $resource (int (get $merged $resource)) (get $from $resource) (int $milli) $model) }}
{{- end }}
{{- $_ := set $merged $resource $milli }}
{{- $_ := set $from $resource $model }}
{{- end }}
{{- end }}
{{- $out := list -}}
{{- range $resource := keys $merged | sortAlpha }}
{{- $out = append $out (dict "input" $resource "strategy" "Replace" "outputs" (dict $.Values.kueue.resource (printf "%d" (int (get $merged $resource))))) }}
{{- end }}
{{- with .Values.kueue.hami }}{{ if .enabled }}
{{- if or (hasKey $merged .countResource) (hasKey $merged .memoryResource) (eq .countResource .memoryResource) }}
{{- fail (printf "kueue.hami.countResource: %s is also the resource of whole GPUs or MIG instances (or HAMi's memory), so Kueue would charge each HAMi share a whole GPU; give HAMi's resourceCountName (its chart's resourceName) a name of its own, e.g. nvidia.com/vgpu, and set it here" .countResource) }}
{{- end }}
{{- /* a share's memory in MiB -> thousandths of a GPU of gpuMemoryMiB: 1000/MiB per MiB, cut
  to nano (a Quantity keeps 9 decimals and rounds up) and rounded down, so that Kueue never
  charges more than the hub; the count is charged nothing */}}
{{- $perMiB := printf "%dn" (div (int64 1000000000000) (int64 .gpuMemoryMiB)) }}
{{- $out = append $out (dict "input" .countResource "strategy" "Replace" "outputs" (dict $.Values.kueue.resource "0")) }}
{{- $out = append $out (dict "input" .memoryResource "strategy" "Replace" "outputs" (dict $.Values.kueue.resource $perMiB)) }}
{{- end }}{{ end }}
{{- toYaml $out -}}
{{- end }}

{{/*
The hub's ServiceAccount, which gpupool's RoleBinding and ClusterRoleBinding name. With the
JupyterHub chart as dependency: the name that chart gives it, through its own helper
(jupyterhub.hub-serviceaccount.fullname in its _helpers-names.tpl), so that fullnameOverride,
nameOverride and hub.serviceAccount.name/create are followed. That helper reads
.Values.hub.serviceAccount, so it gets the JupyterHub chart's values as its context (.Chart.Name
"jupyterhub" makes its jupyterhub.fullname read .Values.fullnameOverride/nameOverride there).
Without the dependency (the JupyterHub chart installed on its own, or charts/ not filled):
rbac.hubServiceAccount.
*/}}
{{- define "gpupool.hubServiceAccount" -}}
{{- if and .Values.jupyterhub.enabled (hasKey (.Subcharts | default dict) "jupyterhub") }}
{{- include "jupyterhub.hub-serviceaccount.fullname" (dict "Values" .Values.jupyterhub "Chart" (dict "Name" "jupyterhub") "Release" .Release) }}
{{- else }}
{{- .Values.rbac.hubServiceAccount }}
{{- end }}
{{- end }}

{{/*
gpupool's config reaches the hub through jupyterhub.hub.extraVolumes/extraVolumeMounts (the
gpupool-config ConfigMap at /etc/gpupool, which extraConfig.zz-gpupool loads). Helm replaces a
list rather than merging it, so an admin's own list drops the chart's entries and the hub would
stop on a missing /etc/gpupool/gpupool.json: refuse the render, saying what to add. (The config
is rendered from gpupool.* by templates, so it cannot travel in a values map such as
hub.extraFiles, which Helm would merge key by key.)
*/}}
{{- define "gpupool.validateHubMounts" -}}
{{- $hub := .Values.jupyterhub.hub | default dict }}
{{- if .Values.jupyterhub.enabled }}
{{- $names := list }}
{{- range $volume := ($hub.extraVolumes | default list) }}
{{- if eq (($volume.configMap | default dict).name | default "") "gpupool-config" }}{{ $names = append $names $volume.name }}{{ end }}
{{- end }}
{{- if not $names }}
{{- fail "jupyterhub.hub.extraVolumes: Helm replaces the chart's list with yours, which leaves out gpupool's config (the hub would not find /etc/gpupool/gpupool.json); add `{name: gpupool-config, configMap: {name: gpupool-config}}` to it" }}
{{- end }}
{{- $mounted := false }}
{{- range $mount := ($hub.extraVolumeMounts | default list) }}
{{- if and (has $mount.name $names) (eq (trimSuffix "/" ($mount.mountPath | default "")) "/etc/gpupool") (not $mount.subPath) }}{{ $mounted = true }}{{ end }}
{{- end }}
{{- if not $mounted }}
{{- fail "jupyterhub.hub.extraVolumeMounts: Helm replaces the chart's list with yours, which leaves out gpupool's config (the hub would not find /etc/gpupool/gpupool.json); add `{name: gpupool-config, mountPath: /etc/gpupool, readOnly: true}` to it" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The JupyterHub chart's image pullers (the hook-image-puller and continuous-image-puller
DaemonSets) pre-pull the notebook image on the nodes where notebooks may run, with the
tolerations scheduling.userPods.tolerations + singleuser.extraTolerations +
prePuller.extraTolerations (its templates/image-puller/_helpers-daemonset.tpl). GPU nodes are
tainted (nvidia.com/gpu on GKE), so without gpupool's GPU tolerations there the image is never
pre-pulled onto them, and each node's first GPU spawn pulls it within the start timeout. Values
cannot refer to values, so values.yaml sets jupyterhub.prePuller.extraTolerations to the default
gpupool.gpuTolerations and this check keeps the two in step: each GPU toleration must be covered
by a puller toleration (same key, or Exists on that key or on every key; its effect or none).
*/}}
{{- define "gpupool.validatePullers" -}}
{{- $jh := .Values.jupyterhub }}
{{- $pre := $jh.prePuller | default dict }}
{{- if and $jh.enabled (or ($pre.hook | default dict).enabled ($pre.continuous | default dict).enabled) }}
{{- $userPods := (($jh.scheduling | default dict).userPods | default dict).tolerations | default list }}
{{- $singleuser := ($jh.singleuser | default dict).extraTolerations | default list }}
{{- $have := concat $userPods $singleuser ($pre.extraTolerations | default list) }}
{{- range $gpu := (.Values.gpupool.gpuTolerations | default list) }}
{{- $covered := false }}
{{- range $puller := $have }}
{{- $key := eq ($puller.key | default "") ($gpu.key | default "") }}
{{- $exists := eq ($puller.operator | default "Equal") "Exists" }}
{{- $keyOk := or (and $exists (or (not $puller.key) $key)) (and $key (ne ($gpu.operator | default "Equal") "Exists") (eq ($puller.value | default "") ($gpu.value | default ""))) }}
{{- $effectOk := or (not $puller.effect) (eq ($puller.effect | default "") ($gpu.effect | default "")) }}
{{- if and $keyOk $effectOk }}{{ $covered = true }}{{ end }}
{{- end }}
{{- if not $covered }}
{{- fail (printf "jupyterhub.prePuller.extraTolerations: the JupyterHub chart's image pullers would not tolerate gpupool.gpuTolerations' %s, so the notebook image would never be pre-pulled onto GPU nodes tainted so; add `%s` to it" ($gpu.key | default "(any key)") (toJson $gpu)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
